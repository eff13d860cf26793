"""`kvserve deploy ray --config`: the shipped sample parses, a bad config is one line naming
the key (exit 2, no Ray started, no traceback), and the config becomes the `kvserve serve`
flags each replica runs and Serve's autoscaling_config."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from stream_endings import assert_chat_stream_failed, assert_responses_stream_failed, sse_events

from kvserve.deploy.ray_config import DeployConfigError, load_config, parse_config
from kvserve.deploy.ray_serve import autoscaling_config


def test_sample_config_parses():
    cfg = load_config("deploy/ray/deploy.yaml")
    assert cfg.autoscaling.min_replicas == 1 and cfg.routing.policy == "cache-aware"
    argv = cfg.server_argv(8123)
    assert argv[:2] == ["serve", "smollm2-135m"] and "--kv-cache-memory" in argv and "8123" in argv


def test_engine_settings_become_serve_flags():
    cfg = parse_config(
        {"engine": {"max-num-seqs": 4, "enable_prefix_caching": False}, "server_args": ["--x"]}
    )
    argv = cfg.server_argv(1)
    assert argv[argv.index("--max-num-seqs") + 1] == "4"
    assert "--no-enable-prefix-caching" in argv and argv[-1] == "--x"


def test_autoscaling_config_is_serves():
    cfg = parse_config({"autoscaling": {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2}})
    got = autoscaling_config(cfg)
    assert got["max_replicas"] == 3 and got["target_ongoing_requests"] == 2
    assert "initial_replicas" not in got  # unset: Serve's default (min_replicas)
    pytest.importorskip("ray.serve")
    from ray.serve.config import AutoscalingConfig

    AutoscalingConfig(**got)  # every key is one Serve takes


def test_the_front_and_the_replicas_have_one_body_limit():
    """http.max_request_bytes had to be set by hand beside the replicas' --max-request-bytes:
    raising only the replicas' (as kvserve serve is raised) left the front's 16 MiB 413 in the
    way, and raising only the front's left the replicas' 16 MiB. Now one setting is both."""
    default = parse_config({})
    assert default.max_request_bytes == 16 * 2**20 and "--max-request-bytes" not in default.server_argv(1)
    for args in (["--max-request-bytes", "40000000"], ["--max-request-bytes=40000000"]):
        assert parse_config({"server_args": args}).max_request_bytes == 40_000_000  # the front follows
    front = parse_config({"http": {"max_request_bytes": 1000}})
    argv = front.server_argv(1)
    assert front.max_request_bytes == 1000 and argv[argv.index("--max-request-bytes") + 1] == "1000"
    same = {"http": {"max_request_bytes": 1000}, "server_args": ["--max-request-bytes", "1000"]}
    assert parse_config(same).server_argv(1).count("--max-request-bytes") == 1
    with pytest.raises(DeployConfigError, match=r"^http.max_request_bytes: 1000 differs from server_args"):
        parse_config({**same, "server_args": ["--max-request-bytes", "2000"]})
    pytest.importorskip("ray.serve")
    from kvserve.deploy.ray_serve import build_app

    app = build_app(parse_config({"server_args": ["--max-request-bytes", "40000000"]}))
    assert app._bound_deployment.init_args[1] == 40_000_000  # the front's own limit


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"autoscaling": {"max_replicas": 0}}, "autoscaling.max_replicas: "),
        ({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "autoscaling: max_replicas (2) is below"),
        ({"autoscaling": {"min_replicas": 0}}, "autoscaling.min_replicas: "),
        ({"engine": {"kv_cache_mem": "1GiB"}}, "engine: 'kv_cache_mem' is not an engine setting"),
        # engine values: these passed and then failed every replica's start
        ({"engine": {"max_num_seqs": "many"}}, "engine.max_num_seqs: 'many' is not a valid int"),
        ({"engine": {"kv_cache_memory": "lots"}}, "engine.kv_cache_memory: invalid memory size 'lots'"),
        ({"engine": {"max_num_seqs": 0}}, "engine.max_num_seqs: must be >= 1"),
        ({"engine": {"enforce_eager": "yes"}}, "engine.enforce_eager: 'yes' is not a valid bool"),
        ({"routing": {"policy": "fastest"}}, "routing.policy: 'fastest' is not one of"),
        ({"routing": {"cache_aware": {"tau": 1}}}, "routing.cache_aware: 'tau' is not one of"),
        # thresholds with another policy were dropped without a word
        (
            {"routing": {"policy": "round-robin", "cache_aware": {"balance_abs_threshold": 1}}},
            "routing: cache_aware: thresholds apply only to policy 'cache-aware', not 'round-robin'",
        ),
        ({"replica": {"cpus": 1}}, "replica.cpus: unknown key"),
        ({"http": {"port": "eighty"}}, "http.port: "),
        ({"route_prefix": "v1"}, "route_prefix: must start with '/'"),
        ([1, 2], "(top level): expected a mapping"),
        # these passed and then failed later: a traceback, every replica's start, or every request
        ({"engine": {"max_num_seqs": float("inf")}}, "engine.max_num_seqs: inf is not a finite number"),
        ({"autoscaling": {"target_ongoing_requests": float("inf")}}, "autoscaling.target_ongoing_requests: "),
        ({"routing": {"cache_aware": {"recent_work_tau": 0}}}, "routing.cache_aware: recent_work_tau: must"),
        ({"routing": {"cache_aware": {"balance_rel_threshold": float("nan")}}}, "routing.cache_aware."),
        ({"routing": {"cache_aware": {"cache_threshold": 2}}}, "routing.cache_aware: cache_threshold: must"),
        ({"server_args": ["--port", "9000"]}, "server_args: --port is set by each replica"),
        ({"server_args": ["--host=0.0.0.0"]}, "server_args: --host is set by each replica"),
    ],
)
def test_bad_config_names_the_key(doc, message):
    with pytest.raises(DeployConfigError) as e:
        parse_config(doc)
    assert str(e.value).startswith(message), str(e.value)


def test_cli_bad_config_exits_2_with_one_line(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text("autoscaling:\n  max_replicas: -1\n")
    out = subprocess.run(
        [sys.executable, "-m", "kvserve.entrypoints.cli", "deploy", "ray", "--config", str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("error: autoscaling.max_replicas:")
    assert "Traceback" not in out.stderr
    path.write_text("autoscaling: [unclosed\n")
    out = subprocess.run(
        [sys.executable, "-m", "kvserve.entrypoints.cli", "deploy", "ray", "--config", str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "not valid YAML" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "kvserve.entrypoints.cli", "deploy", "ray", "--config", str(tmp_path / "no")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "No such file" in out.stderr


@pytest.mark.parametrize(
    "body, says", [(b"[" * 100_000, "nested too deeply"), (b"{", "not valid JSON"), (b"[1]", "a JSON object")]
)
def test_front_answers_a_body_it_cannot_use_with_a_400(body, says):
    """The Ray Serve ingress parses each body itself: one nested past the parser's recursion
    limit raised RecursionError, not ValueError, and was a 500 with a traceback."""
    import json

    pytest.importorskip("ray.serve")
    resp, answer = _front_post(None, body=body)
    err = json.loads(answer)["error"]
    assert resp.status_code == 400 and err["code"] == "invalid_json" and says in err["message"], err


def test_front_answers_a_body_sent_as_a_form_with_a_400_naming_its_content_type():
    """`curl -d '{...}'` sends Content-Type application/x-www-form-urlencoded: kvserve serve
    answers 400, the front read the body as JSON and had a replica serve it."""
    import json

    pytest.importorskip("ray.serve")
    form = "application/x-www-form-urlencoded"
    resp, answer = _front_post(None, body=STREAMED_CHAT, content_type=form)  # (no replica reached)
    err = json.loads(answer)["error"]
    assert resp.status_code == 400 and err["code"] == "invalid_json" and form in err["message"], err


@pytest.mark.parametrize("prev, kind", [(123, "a number"), ([], "an array"), ({}, "an object")])
def test_front_answers_a_previous_response_id_that_is_no_string_with_a_400_naming_its_type(prev, kind):
    """The front looked a previous_response_id of 123 or [] up as an id: a 400
    previous_response_not_found, where kvserve serve names the field's wrong type."""
    import json

    pytest.importorskip("ray.serve")
    body = json.dumps({"model": "m", "input": "hi", "previous_response_id": prev}).encode()
    resp, answer = _front_post(None, "responses", body)
    err = json.loads(answer)["error"]
    assert resp.status_code == 400 and err["param"] == "previous_response_id", err
    assert err["code"] == "invalid_value", err
    assert f"must be a string (a response id), got {kind}" in err["message"], err


class _Handle:
    """Serve's DeploymentHandle as the front uses it, over replica answers given as parts (a
    meta dict, byte chunks) where an exception is the replica failing at that point."""

    def __init__(self, *parts) -> None:
        self.parts = parts
        self.forward = SimpleNamespace(remote=lambda *a, **k: self._gen())

    def options(self, **_):
        return self

    async def _gen(self):
        for part in self.parts:
            if isinstance(part, Exception):
                raise part
            yield part


class _RayTaskError(Exception):
    """As Ray hands a replica's exception to its caller: the actor's traceback header as its
    text, the exception itself as `cause`."""

    def __init__(self, cause: Exception) -> None:
        super().__init__("\x1b[36mray::ServeReplica:app:KVServeReplica.handle_request()\x1b[39m (pid=1)")
        self.cause = cause


STREAMED_CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true}'


def _front_post(handle, path: str = "chat/completions", body: bytes = STREAMED_CHAT, content_type: str = ""):
    """(response, its body) of the Ray front's POST of `body` to /v1/`path`, its replicas `handle`."""
    import asyncio

    from starlette.requests import Request

    from kvserve.deploy.front import Front

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def run():
        headers = [(b"content-type", content_type.encode())] if content_type else []
        scope = {"type": "http", "method": "POST", "path": f"/v1/{path}", "headers": headers}
        front = SimpleNamespace(max_request_bytes=2**20, replicas=handle)
        front._relay = lambda *a: Front._relay(front, *a)
        resp = await Front.post(front, path, Request(scope, receive))
        if not hasattr(resp, "body_iterator"):
            return resp, resp.body
        return resp, b"".join([chunk async for chunk in resp.body_iterator])

    return asyncio.run(run())


def test_a_replica_failing_mid_stream_ends_the_stream_with_an_error_event():
    """A replica whose server died mid-stream raised through the front's relay: the stream was
    cut with no word (the client read a short answer as a whole one, no error, no [DONE]).
    Now it ends with an error event in OpenAI's shape, as the gateway's and the pd-proxy's do;
    and a replica failing before it answered is a 502 in OpenAI's shape, not Serve's 500."""
    import json

    pytest.importorskip("ray.serve")
    meta = {"status": 200, "content_type": "text/event-stream; charset=utf-8", "replica": "r1"}
    first = b'data: {"choices": [{"index": 0, "delta": {"content": "Hel"}}]}\n\n'
    resp, body = _front_post(_Handle(meta, first, _RayTaskError(ConnectionError("server gone"))))
    assert resp.status_code == 200 and body.startswith(first), body
    events = [e for e in body.split(b"\n\n") if e.strip()]
    err = json.loads(events[-2].removeprefix(b"data: "))["error"]  # (then [DONE])
    assert err["type"] == "server_error" and err["code"] == "upstream_error", err
    assert "failed mid-stream (ConnectionError: server gone)" in err["message"], err  # (not Ray's text)
    resp, body = _front_post(_Handle(ConnectionError("no server")))
    err = json.loads(body)["error"]
    assert resp.status_code == 502 and err["code"] == "upstream_error" and "no server" in err["message"]


def test_a_stream_a_replica_broke_off_ends_as_kvserve_serve_ends_a_failed_one():
    """The front's error event for a replica failing mid-stream came with no `data: [DONE]`
    (kvserve serve sends its error event, then [DONE]: clients reading to [DONE] waited), and a
    Responses stream got chat's error shape. Now chat's error event and [DONE]; a Responses
    stream its own error event, numbered after the events sent (2), and no [DONE]."""
    pytest.importorskip("ray.serve")
    meta = {"status": 200, "content_type": "text/event-stream; charset=utf-8", "replica": "r1"}
    first = b'data: {"choices": [{"index": 0, "delta": {"content": "Hel"}}]}\n\n'
    _, body = _front_post(_Handle(meta, first, _RayTaskError(ConnectionError("server gone"))))
    assert_chat_stream_failed(sse_events(body), "failed mid-stream")
    created = b'event: response.created\ndata: {"type": "response.created", "sequence_number": 0}\n\n'
    delta = b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta"}\n\n'
    streamed = b'{"model": "m", "input": "hi", "stream": true}'
    handle = _Handle(meta, created + delta, _RayTaskError(ConnectionError("server gone")))
    resp, body = _front_post(handle, "responses", streamed)
    assert resp.status_code == 200
    assert_responses_stream_failed(sse_events(body), 2, "failed mid-stream")


def test_the_front_counts_input_tokens_on_the_replica_the_previous_response_id_names():
    """POST /v1/responses/input_tokens (the SDK's responses.input_tokens.count) went to any
    replica with the front's public previous_response_id, which no replica knows: a 400
    previous_response_not_found. It goes to the replica the id names now, with its own id."""
    import json

    pytest.importorskip("ray.serve")
    from kvserve.routing.responses_ids import encode_id

    meta = {"status": 200, "content_type": "application/json", "replica": "r1"}
    handle, calls = _Handle(meta, b'{"object": "response.input_tokens", "input_tokens": 7}'), []
    handle.forward = SimpleNamespace(remote=lambda *a, **k: calls.append((a, k)) or handle._gen())
    body = {"model": "m", "input": "hi", "previous_response_id": encode_id("r1", "resp_abc")}
    resp, answer = _front_post(handle, "responses/input_tokens", json.dumps(body).encode())
    assert resp.status_code == 200 and json.loads(answer)["input_tokens"] == 7
    (target, sent, _), kwargs = calls[0]
    assert target == "/v1/responses/input_tokens" and kwargs == {"pin": "r1"}
    assert sent["previous_response_id"] == "resp_abc"
    resp, answer = _front_post(
        handle, "responses/input_tokens", json.dumps({**body, "previous_response_id": 1}).encode()
    )
    assert resp.status_code == 400 and json.loads(answer)["error"]["param"] == "previous_response_id"


def test_the_front_cancels_a_response_on_the_replica_its_id_names():
    """POST /v1/responses/{id}/cancel (OpenAI's responses.cancel) was taken by the front's
    catch-all POST route as a generation: a 400 for its empty body. It goes to the replica the
    id names now, as GET and DELETE do."""
    import asyncio

    pytest.importorskip("ray.serve")
    from starlette.requests import Request
    from starlette.routing import Match

    from kvserve.deploy.front import Front, app
    from kvserve.routing.responses_ids import encode_id

    public = encode_id("r1", "resp_abc")
    scope = {"type": "http", "method": "POST", "path": f"/v1/responses/{public}/cancel", "headers": [],
             "query_string": b""}  # fmt: skip
    # (Ray's serve.ingress includes the app's routes as a router of their own: its routes, in order)
    routes = [
        x for r in app.routes for x in (r.original_router.routes if hasattr(r, "original_router") else [r])
    ]
    route = next(r for r in routes if r.matches(scope)[0] == Match.FULL)
    assert route.name == "cancel", route.name
    calls = []

    async def stored(*args, **kwargs):
        calls.append((args, kwargs))
        return 200, "application/json", b'{"id": "x"}'

    front = SimpleNamespace(replicas=SimpleNamespace(stored=SimpleNamespace(remote=stored)),
                            _stored=lambda *a: Front._stored(front, *a))  # fmt: skip
    resp = asyncio.run(Front.cancel(front, public, Request(scope)))
    assert resp.status_code == 200 and resp.headers["x-kvserve-replica"] == "r1"
    assert calls == [(("POST", "resp_abc", "", {}), {"pin": "r1", "tail": "/cancel"})], calls


def test_the_front_serves_kvserve_serves_token_routes_version_and_ping():
    """/tokenize (how the gateway counts a deployment's prompt tokens), /detokenize, /version
    and vLLM's /ping were 404s through the front; a replica answers them now."""
    import asyncio

    pytest.importorskip("ray.serve")
    from starlette.requests import Request
    from starlette.routing import Match

    from kvserve.deploy.front import Front, app

    routes = [
        x for r in app.routes for x in (r.original_router.routes if hasattr(r, "original_router") else [r])
    ]
    expected = [("POST", "/tokenize", "tokenize"), ("POST", "/detokenize", "detokenize"), ("GET", "/version",
                "version"), ("GET", "/ping", "ping"), ("POST", "/ping", "ping")]  # fmt: skip
    for method, path, name in expected:
        scope = {"type": "http", "method": method, "path": path, "headers": [], "query_string": b""}
        assert next(r.name for r in routes if r.matches(scope)[0] == Match.FULL) == name, path
    meta = {"status": 200, "content_type": "application/json", "replica": "r1"}
    handle, gets = _Handle(meta, b'{"count": 3}'), []

    async def get(path, headers):
        gets.append(path)
        return 200, "application/json", b"{}"

    handle.get = SimpleNamespace(remote=get)
    sent = []
    handle.forward = SimpleNamespace(remote=lambda *a, **k: sent.append(a[:2]) or handle._gen())
    front = SimpleNamespace(max_request_bytes=2**20, replicas=handle)
    front._relay, front._get = (lambda *a: Front._relay(front, *a)), (lambda *a: Front._get(front, *a))

    async def run():
        async def receive() -> dict:
            return {"type": "http.request", "body": b'{"prompt": "a b c"}', "more_body": False}

        scope = {"type": "http", "method": "POST", "path": "/tokenize", "headers": [], "query_string": b""}
        resp = await Front.tokenize(front, Request(scope, receive))
        body = b"".join([c async for c in resp.body_iterator])
        await Front.ping(front, Request(scope))
        await Front.version(front, Request(scope))
        return resp.status_code, body

    assert asyncio.run(run()) == (200, b'{"count": 3}')
    assert sent == [("/tokenize", {"prompt": "a b c"})] and gets == ["/health", "/version"], (sent, gets)


@pytest.mark.parametrize("declared", [True, False])
def test_front_refuses_a_body_over_its_limit_before_reading_it_whole(declared):
    """The front read every body whole (then parsed it and copied it to a replica), however
    large: one upload took its memory. Now past http.max_request_bytes it is a 413, refused from
    a declared length before reading, or as soon as a chunked body passes the limit."""
    import asyncio
    import json

    pytest.importorskip("ray.serve")
    from starlette.requests import Request

    from kvserve.deploy.front import Front

    chunks = [b'{"prompt": "' + b"a" * 600, b"a" * 600 + b'"}', b"never read"]

    async def receive() -> dict:
        return {"type": "http.request", "body": chunks.pop(0), "more_body": bool(chunks)}

    headers = [(b"content-length", b"5000")] if declared else []
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    front = SimpleNamespace(max_request_bytes=1000)
    front._relay = lambda *a: Front._relay(front, *a)
    resp = asyncio.run(Front.post(front, "completions", Request(scope, receive)))
    err = json.loads(resp.body)["error"]
    assert resp.status_code == 413 and err["code"] == "request_too_large" and "1000 bytes" in err["message"]
    assert len(chunks) == (3 if declared else 1)  # nothing read / not past the limit


def test_a_replica_relays_a_lone_surrogate_and_a_latin1_header_as_they_came():
    """KVServeReplica.forward sent the body with httpx's json= (strict UTF-8: a lone surrogate,
    valid JSON, raised UnicodeEncodeError) and header values as str (encoded as ASCII: an
    'é' raised): an exception in the replica, a 500 with a traceback for the client. Sent to a
    real HTTP server (the fault backend), both now arrive."""
    import asyncio
    import json

    import httpx
    from gateway_utils import FaultBackend

    from kvserve.deploy.replica import KVServeReplica

    fb = FaultBackend()
    try:
        replica = object.__new__(KVServeReplica)  # (no `kvserve serve` child: the relay alone)
        replica.client, replica.replica_id = None, "r0"
        body = json.loads('{"model": "ok", "prompt": "a \\ud800 b", "max_tokens": 2}')
        headers = {"authorization": "Bearer caf\u00e9", "content-type": "application/json"}

        async def relay() -> list:
            async with httpx.AsyncClient(base_url=fb.url) as replica.client:
                return [part async for part in replica.forward("/v1/completions", body, headers)]

        meta, *chunks = asyncio.run(relay())
        assert meta["status"] == 200, b"".join(chunks)
        assert json.loads(b"".join(chunks))["usage"]["prompt_tokens"] == 3
    finally:
        fb.stop()


def test_the_replicas_retry_after_reaches_the_client():
    """The front answered with the replica server's status, type and body but none of its
    headers: a 503's Retry-After (the engine restarting, the server draining) was lost, which
    kvserve serve, the gateway and the pd-proxy return. The replica now relays it and the front
    sends it on (not X-Request-Id: Serve's proxy answers with its own, the one the server got)."""
    import asyncio

    import httpx
    from gateway_utils import FaultBackend

    from kvserve.deploy.replica import KVServeReplica

    pytest.importorskip("ray.serve")
    fb = FaultBackend()
    try:
        replica = object.__new__(KVServeReplica)  # (no `kvserve serve` child: the relay alone)
        replica.client, replica.replica_id = None, "r0"
        body = {"model": "fail-429", "prompt": "a", "max_tokens": 2}

        async def relay() -> list:
            async with httpx.AsyncClient(base_url=fb.url) as replica.client:
                return [part async for part in replica.forward("/v1/completions", body, {})]

        meta, *_ = asyncio.run(relay())
    finally:
        fb.stop()
    assert meta["status"] == 429 and meta["headers"] == {"retry-after": "1"}, meta
    resp, _ = _front_post(_Handle(meta, b'{"error": {"message": "slow down"}}'))
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1", resp.headers
    assert resp.headers["x-kvserve-replica"] == "r0"


@pytest.mark.parametrize(
    "server_args, says",
    [
        (["--max-nm-seqs", "4"], "server_args: unrecognized arguments: --max-nm-seqs 4"),
        (["--kv-cache-memory"], "server_args: argument --kv-cache-memory: expected one argument"),
    ],
)
def test_replica_flags_kvserve_serve_would_refuse_stop_the_deploy(tmp_path, capsys, server_args, says):
    """server_args went to every replica's `kvserve serve` unchecked: a misspelled flag passed
    `kvserve deploy ray`, then every replica exited at start once the cluster was up. They are
    now parsed with serve's own parser first: exit 2, one line, no Ray started."""
    import yaml

    from kvserve.deploy.cli import check_server_flags
    from kvserve.entrypoints.cli import build_parser, main

    serve_parser = build_parser().parse_args(["deploy", "ray", "--config", "-"]).serve_parser
    assert check_server_flags(parse_config({"server_args": server_args}), serve_parser) == says
    assert check_server_flags(parse_config({"server_args": ["--max-num-seqs", "4"]}), serve_parser) is None
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({"server_args": server_args}))
    assert main(["deploy", "ray", "--config", str(path)]) == 2  # (before Ray is imported)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {says}"], err


@pytest.mark.parametrize(
    "method, path",
    [("POST", "/v1/files"), ("GET", "/v1/batches"), ("POST", "/v1/batches"),
     ("GET", "/v1/files/file-1/content"), ("POST", "/v1/batches/batch_1/cancel"),
     ("DELETE", "/v1/files/file-1")],
)  # fmt: skip
def test_the_front_answers_the_batch_api_with_a_404_saying_where_batches_go(method, path):
    """POST /v1/files (a multipart upload) went to the front's catch-all POST route: a 400 "the
    body is not valid JSON"; GET /v1/batches was a 405. Both read as a broken deployment. The
    Batch API is not routed to replicas (its files live on one, which Serve may remove): a 404
    `unsupported_endpoint` in OpenAI's shape that says so, whatever the body."""
    import asyncio
    import json

    pytest.importorskip("ray.serve")
    from starlette.requests import Request
    from starlette.routing import Match

    from kvserve.deploy.front import Front, app

    routes = [
        x for r in app.routes for x in (r.original_router.routes if hasattr(r, "original_router") else [r])
    ]
    scope = {"type": "http", "method": method, "path": path, "query_string": b"",
             "headers": [(b"content-type", b"multipart/form-data; boundary=x")]}  # fmt: skip
    route = next(r for r in routes if r.matches(scope)[0] == Match.FULL)
    assert route.name == "batch_api", route.name
    resp = asyncio.run(Front.batch_api(SimpleNamespace(), Request(scope)))
    err = json.loads(resp.body)["error"]
    assert resp.status_code == 404 and err["code"] == "unsupported_endpoint", err
    assert err["type"] == "invalid_request_error" and path in err["message"], err
    assert "kvserve run-batch" in err["message"], err


def test_front_metrics_is_a_404_saying_where_a_ray_deployments_metrics_are():
    """GET /metrics on the Ray Serve front was the generic 404 "Not Found: GET /metrics": a
    Prometheus scrape set up as for kvserve serve failed with no word of where the metrics are.
    They are Ray's (Serve's ray_serve_* series on each node's metrics export port)."""
    import asyncio
    import json

    pytest.importorskip("ray.serve")
    from kvserve.deploy.front import Front

    resp = asyncio.run(Front.metrics(SimpleNamespace()))
    err = json.loads(resp.body)["error"]
    assert resp.status_code == 404 and err["code"] == "unsupported_endpoint", err
    assert "ray_serve_" in err["message"] and "--metrics-export-port" in err["message"], err
