"""Prefill/decode disaggregation in one process: a producer engine computes each prompt (one
token), a consumer engine pulls the prompt's KV and decodes. Greedy output equals a single
engine's and transformers', for short and chunked prompts, with prefix-cache hits on either
side, every connector, fp32 and 1-byte KV caches."""

from __future__ import annotations

import json
import time

import pytest
from helpers import assert_greedy_match, reference_greedy

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.kv_transfer.config import parse_kv_transfer_config
from kvserve.kv_transfer.params import check_kv_transfer_params
from kvserve.kv_transfer.peers import allowed
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams

TEXT = (
    "In a quiet village by the sea, the fishermen rose before dawn to mend their nets and talk about "
    "the weather, the prices at the market and the stories of old sailors. "
) * 40


def _engine(model: str, connector: str | None, role: str | None = None, tmp=None, **kw) -> LLMEngine:
    kt = None
    if connector:
        extra = {"kv_path": str(tmp)} if connector == "disk" else {}
        kt = json.dumps({"kv_connector": connector, "kv_role": role, **extra})
    return LLMEngine(EngineConfig(model=model, kv_cache_memory="96MiB", kv_transfer_config=kt, **kw))


def _run(engine: LLMEngine, rid: str | None, prompt: list[int] | None, params: SamplingParams | None):
    """Run a request to the end (rid None: one already added) and return its final output."""
    if rid is not None:
        engine.add_request(rid, prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    return final


def _disaggregated(prod: LLMEngine, cons: LLMEngine, rid: str, prompt: list[int], max_tokens: int):
    """Prefill on the producer (one token, KV kept), decode on the consumer; both pools settle."""
    first = _run(
        prod,
        "p-" + rid,
        prompt,
        SamplingParams(temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
    )
    params = first.kv_transfer_params
    assert params["do_remote_prefill"] and params["remote_num_tokens"] == len(prompt) - 1
    out = _run(
        cons,
        "c-" + rid,
        prompt,
        SamplingParams(temperature=0, max_tokens=max_tokens, kv_transfer_params=params),
    )
    prod.core.poll_transfers()  # the pulled lease's blocks go back to the producer's pool
    for e in (prod, cons):
        kv = e.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks, "blocks left held after the transfer"
    return first, out


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_default_model_disaggregated_equals_single_engine(kv_dtype, default_reference):
    """Short and chunked (> the 128-token step budget) prompts; then the same long prompt again
    (a hit on the producer's cache; the consumer holds all but its last block already) and one
    sharing its first 160 tokens with it (a hit on the consumer's cache: only the rest is
    pulled). Each equals the consumer computing the prompt itself (under another cache_salt,
    so from nothing), and with an fp32 cache the short ones equal transformers. (A 128-token
    budget chunks a 200-token prompt as the default budget chunks a 560-token one, at a third
    of the prefill's cost.)"""
    prod = _engine("smollm2-135m", "tcp", "kv_producer", kv_cache_dtype=kv_dtype, max_num_batched_tokens=128)
    cons = _engine("smollm2-135m", "tcp", "kv_consumer", kv_cache_dtype=kv_dtype, max_num_batched_tokens=128)
    try:
        if kv_dtype == "auto":
            _check_default_pair(prod, cons, default_reference, [0, 2, 3, 4])
        else:  # a 1-byte cache read back: a chunked prompt, then a consumer-side hit
            _check_default_pair(prod, cons, None, [2, 4])
    finally:
        for e in (prod, cons):
            e.core.shutdown()


def _check_default_pair(prod: LLMEngine, cons: LLMEngine, reference, cases: list[int]) -> None:
    ids = prod.tokenizer.encode(TEXT, add_special_tokens=False)
    prompts = [ids[:9], ids[3:36], ids[5 : 5 + 200], ids[5 : 5 + 200], ids[5 : 5 + 160] + ids[600:640]]
    eos = sorted(prod.eos_token_ids)
    stats = cons.core.connector.stats
    block_bytes = sum(cons.core.connector.io.block_bytes())
    alone_tokens: dict[tuple, list[int]] = {}
    for i in cases:
        p = prompts[i]
        before = (stats.loads, stats.load_bytes)
        hits_before = prod.kv_cache_manager.prefix_cache_hits
        first, out = _disaggregated(prod, cons, str(i), p, 8)
        got = out.outputs[0].token_ids
        if tuple(p) not in alone_tokens:  # the consumer computing it itself, from nothing
            cons.add_request(f"alone-{i}", p, SamplingParams(temperature=0, max_tokens=8), cache_salt=f"a{i}")
            alone = _run(cons, None, None, None)
            assert alone.num_cached_tokens == 0
            alone_tokens[tuple(p)] = alone.outputs[0].token_ids
        assert got == alone_tokens[tuple(p)], f"prompt {i}: disaggregated differs from one engine"
        assert first.outputs[0].token_ids[0] == got[0]
        if reference is not None and i < 2:  # (one engine equals transformers on long prompts: test_fidelity)
            assert_greedy_match(reference, p, reference_greedy(reference, p, 8, eos), got, f"prompt {i}")
        assert stats.loads == before[0] + 1 and stats.load_failures == 0
        assert out.num_cached_tokens == len(p) - 1  # every prompt token but the last came from elsewhere
        pulled_blocks = (stats.load_bytes - before[1]) // block_bytes
        if i == 3:
            assert prod.kv_cache_manager.prefix_cache_hits > hits_before, "the producer recomputed it"
            assert pulled_blocks == 1
        elif i == 4:  # 160 tokens = 10 blocks were cached on the consumer: only the rest travelled
            assert pulled_blocks == -(-(len(p) - 1) // 16) - 10
        else:
            assert pulled_blocks == -(-(len(p) - 1) // 16)


@pytest.mark.parametrize("connector,kv_dtype", [("shm", "int8"), ("disk", "fp8_e4m3"), ("tcp", "auto")])
def test_connectors_and_kv_dtypes_equal_single_engine(connector, kv_dtype, tmp_path, tiny_llama_dir):
    prod = _engine(tiny_llama_dir, connector, "kv_producer", tmp_path, kv_cache_dtype=kv_dtype)
    cons = _engine(tiny_llama_dir, connector, "kv_consumer", tmp_path, kv_cache_dtype=kv_dtype)
    single = _engine(tiny_llama_dir, None, kv_cache_dtype=kv_dtype, max_num_batched_tokens=64)
    try:
        for i, n in enumerate([5, 17, 48, 200]):
            p = [(11 * j + i) % 500 + 3 for j in range(n)]
            _, out = _disaggregated(prod, cons, str(i), p, 20)
            ref = _run(single, str(i), p, SamplingParams(temperature=0, max_tokens=20))
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids, f"{connector}/{kv_dtype} prompt {n}"
        assert cons.core.connector.stats.load_failures == 0
    finally:
        for e in (prod, cons, single):
            e.core.shutdown()


def test_mismatched_prompt_is_computed_locally_and_frees_the_lease(tiny_llama_dir):
    """A consumer whose prompt is not the producer's never uses that KV; the lease is released."""
    prod = _engine(tiny_llama_dir, "tcp", "kv_producer")
    cons = _engine(tiny_llama_dir, "tcp", "kv_consumer")
    single = _engine(tiny_llama_dir, None)
    try:
        p = [(7 * j) % 500 + 3 for j in range(40)]
        params = _run(
            prod,
            "p",
            p,
            SamplingParams(temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
        ).kv_transfer_params
        other = p[:-5] + [9, 9, 9, 9, 9]
        out = _run(cons, "c", other, SamplingParams(temperature=0, max_tokens=12, kv_transfer_params=params))
        assert (
            out.outputs[0].token_ids
            == _run(single, "s", other, SamplingParams(temperature=0, max_tokens=12)).outputs[0].token_ids
        )
        assert cons.core.connector.stats.loads == 0
        kv = prod.kv_cache_manager
        for _ in range(200):  # the release message reaches the producer's transfer thread
            prod.core.poll_transfers()
            if kv.num_free_blocks == kv.num_blocks:
                break
            time.sleep(0.01)
        assert kv.num_free_blocks == kv.num_blocks
    finally:
        for e in (prod, cons, single):
            e.core.shutdown()


def test_a_lease_the_consumer_will_not_use_is_freed_at_once(tiny_llama_dir):
    """A consumer that refuses the request (its prompt + max_tokens past its own context), or
    whose request is aborted while still queued or while its grammar compiles, or that runs
    another connector (shm, for a tcp producer's lease), never pulls: it tells the producer,
    whose pool is full again long before the lease's 30 s are up."""
    prod = _engine(tiny_llama_dir, "tcp", "kv_producer")
    cons = _engine(tiny_llama_dir, "shm", "kv_consumer", max_model_len=64)
    kv = prod.kv_cache_manager
    try:
        p = [(7 * j) % 500 + 3 for j in range(40)]
        cases = [(100, {}), (8, {}), (8, {"json": {"type": "object"}}), (4, None)]
        for i, (max_tokens, extra) in enumerate(cases):
            first = SamplingParams(temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
            params = _run(prod, f"p{i}", p, first).kv_transfer_params
            assert kv.num_free_blocks < kv.num_blocks  # the lease holds the prompt's blocks
            so = StructuredOutputsParams(**extra) if extra else None
            decode = SamplingParams(temperature=0, max_tokens=max_tokens, kv_transfer_params=params,
                                    structured_outputs=so)  # fmt: skip
            if max_tokens > 64:
                with pytest.raises(ValueError, match="maximum context length is 64"):
                    cons.add_request(f"c{i}", p, decode)
            elif extra is None:  # computed here
                assert _run(cons, f"c{i}", p, decode).outputs[0].finish_reason == "length"
            else:
                cons.add_request(f"c{i}", p, decode)
                cons.abort_request(f"c{i}")
            deadline = time.monotonic() + 20  # (the lease's own 30 s: a wide margin on a loaded host)
            while time.monotonic() < deadline:  # the release message reaches the producer's transfer thread
                prod.core.poll_transfers()
                if kv.num_free_blocks == kv.num_blocks:
                    break
                time.sleep(0.005)
            assert kv.num_free_blocks == kv.num_blocks, f"case {i}: the lease still holds its blocks"
            assert prod.core.connector.leases.num_expired == 0
    finally:
        for e in (prod, cons):
            e.core.shutdown()


def test_a_request_refused_for_its_id_releases_its_lease(tiny_llama_dir):
    """A consumer request refused because its request id is in use never reached the input
    processor, so the producer held its prompt's blocks until the lease's 30 s were up; now
    that lease is released at once, while a resent request naming the live one's own lease
    leaves it for the live one to pull."""
    prod = _engine(tiny_llama_dir, "tcp", "kv_producer")
    cons = _engine(tiny_llama_dir, "tcp", "kv_consumer")
    leases, kv = prod.core.connector.leases, prod.kv_cache_manager
    try:
        p = [(7 * j) % 500 + 3 for j in range(40)]
        first = SamplingParams(temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        live, other = (_run(prod, f"p{i}", p, first).kv_transfer_params for i in range(2))
        assert len(leases) == 2
        cons.add_request("c", p, SamplingParams(temperature=0, max_tokens=4, kv_transfer_params=live))
        for params in (other, live):
            again = SamplingParams(temperature=0, max_tokens=4, kv_transfer_params=params)
            with pytest.raises(ValueError, match="request_id: 'c' is already in use"):
                cons.add_request("c", p, again)
        deadline = time.monotonic() + 20  # (the lease's own 30 s: a wide margin on a loaded host)
        while len(leases) > 1 and time.monotonic() < deadline:  # the release reaches the transfer thread
            prod.core.poll_transfers()
            time.sleep(0.005)
        assert len(leases) == 1, "the refused request's lease still holds its blocks"
        assert _run(cons, None, None, None).outputs[0].finish_reason == "length"
        assert cons.core.connector.stats.loads == 1  # the live request pulled its own lease
        prod.core.poll_transfers()
        assert kv.num_free_blocks == kv.num_blocks and leases.num_expired == 0
    finally:
        for e in (prod, cons):
            e.core.shutdown()


def test_disk_tier_survives_a_restart(tmp_path, tiny_llama_dir):
    """kv_both on disk: blocks written by one engine are loaded by a fresh one (same output)."""
    p = [(5 * j) % 500 + 3 for j in range(100)]
    first = _engine(tiny_llama_dir, "disk", "kv_both", tmp_path)
    try:
        a = _run(first, "a", p, SamplingParams(temperature=0, max_tokens=10))
        first.core.connector._pool.shutdown(wait=True)  # the writes are done
        first.core.poll_transfers()
    finally:
        first.core.shutdown()
    second = _engine(tiny_llama_dir, "disk", "kv_both", tmp_path)
    try:
        b = _run(second, "b", p, SamplingParams(temperature=0, max_tokens=10))
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.num_cached_tokens == 96 and second.core.connector.stats.loads == 1  # six full blocks
    finally:
        second.core.shutdown()


@pytest.mark.parametrize(
    "value,message",
    [
        ("{", "not valid JSON"),
        ('{"kv_role": "kv_producer"}', "kv_connector: required"),
        ('{"kv_connector": "rdma", "kv_role": "kv_producer"}', "kv_connector: 'rdma' is not one of"),
        ('{"kv_connector": "tcp", "kv_role": "both"}', "kv_role: 'both' is not one of"),
        ('{"kv_connector": "disk", "kv_role": "kv_both"}', "kv_path: required"),
        ('{"kv_connector": "tcp", "kv_role": "kv_both", "kv_port": 70000}', "kv_port: must be"),
        ('{"kv_connector": "tcp", "kv_role": "kv_both", "lease": 3}', "lease: unknown key"),
        (
            '{"kv_connector": "tcp", "kv_role": "kv_consumer", "kv_producers": "h"}',
            "kv_producers: must be a list",
        ),
        (
            '{"kv_connector": "tcp", "kv_role": "kv_consumer", "kv_producers": ["10.0.0.0/33"]}',
            "not a network",
        ),
        (
            '{"kv_connector": "tcp", "kv_role": "kv_consumer", "kv_producers": ["h:0"]}',
            "port must be in 1-65535",
        ),
        ('{"kv_connector": "tcp", "kv_role": "kv_consumer", "kv_producers": ["a;b"]}', "not a host name"),
    ],
)
def test_bad_kv_transfer_config_names_the_key(value, message):
    with pytest.raises(ValueError, match=message):
        parse_kv_transfer_config(value)


@pytest.mark.parametrize(
    "params,message",
    [
        ([], "must be an object"),
        ({"do_remote_decode": "yes"}, "do_remote_decode: must be a boolean"),
        ({"do_remote_decode": True, "do_remote_prefill": True}, "cannot be combined"),
        ({"do_remote_prefill": True}, "remote_request_id: required"),
        (
            {
                "do_remote_prefill": True,
                "remote_request_id": "x",
                "prompt_digest": "d",
                "kv_connector": "tcp",
                "remote_num_tokens": 4,
            },
            "remote_host: required",
        ),
        ({"surprise": 1}, "surprise: unknown key"),
    ],
)
def test_bad_kv_transfer_params_name_the_key(params, message):
    with pytest.raises(ValueError, match=message):
        check_kv_transfer_params(params)


def test_engine_without_config_refuses_transfer_params(tiny_llama_dir):
    e = _engine(tiny_llama_dir, None)
    with pytest.raises(ValueError, match="kv_transfer_params: this engine runs without --kv-transfer-config"):
        e.add_request("x", [5, 6, 7], SamplingParams(kv_transfer_params={"do_remote_decode": True}))
    cons = _engine(tiny_llama_dir, "tcp", "kv_consumer")
    try:
        with pytest.raises(ValueError, match="do_remote_decode needs a kv_producer"):
            cons.add_request("y", [5, 6, 7], SamplingParams(kv_transfer_params={"do_remote_decode": True}))
    finally:
        cons.core.shutdown()
    with pytest.raises(ValueError, match="kv_transfer_config: runs with tensor, pipeline and data parallel"):
        EngineConfig(
            kv_transfer_config='{"kv_connector": "tcp", "kv_role": "kv_both"}', tensor_parallel_size=2
        )


def _pull_params(host: str, port: int) -> dict:
    return {"do_remote_prefill": True, "remote_request_id": "x", "prompt_digest": "d", "kv_connector": "tcp",
            "remote_num_tokens": 2, "remote_host": host, "remote_port": port}  # fmt: skip


def test_a_consumer_pulls_only_from_the_producers_it_was_given(tiny_llama_dir):
    """A client's kv_transfer_params cannot make the consumer connect anywhere (SSRF): by default
    only producers on this host, otherwise only those in kv_producers; others are refused
    naming remote_host, and the engine serves on."""
    kt = {"kv_connector": "tcp", "kv_role": "kv_consumer", "kv_producers": ["10.0.0.0/8", "prefill.svc:7000"]}
    cons = LLMEngine(
        EngineConfig(model=tiny_llama_dir, kv_cache_memory="16MiB", kv_transfer_config=json.dumps(kt))
    )
    default = parse_kv_transfer_config('{"kv_connector": "tcp", "kv_role": "kv_consumer"}')
    try:
        for host, port in [("169.254.169.254", 80), ("127.0.0.1", 6379), ("11.0.0.1", 5555),
                           ("prefill.svc", 7001), ("x;10.0.0.1", 5555)]:  # fmt: skip
            params = SamplingParams(max_tokens=2, kv_transfer_params=_pull_params(host, port))
            with pytest.raises(ValueError, match=f"remote_host: {host}:{port} is not a producer this engine"):
                cons.add_request("r", [5, 6, 7], params)
        assert not cons.has_unfinished_requests()
        out = _run(cons, "ok", [5, 6, 7], SamplingParams(temperature=0, max_tokens=2))
        assert out.outputs[0].finish_reason == "length"
    finally:
        cons.core.shutdown()
    assert [allowed(peers, h, p) for peers in [default.producer_peers, cons.config.kv_transfer.producer_peers]
            for h, p in [("127.0.0.1", 5), ("0.0.0.0", 5), ("10.9.8.7", 5), ("prefill.svc", 7000)]] == [
        True, True, False, False, False, False, True, True]  # fmt: skip


def test_what_the_proxy_sends_each_engine():
    from kvserve.disagg.split import decode_body, disaggregates, prefill_body

    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True, "n": 1,
            "stream_options": {"include_usage": True}, "logprobs": 2, "min_tokens": 5}  # fmt: skip
    pre = prefill_body(body)
    assert pre["max_tokens"] == 1 and pre["stream"] is False
    assert pre["kv_transfer_params"] == {"do_remote_decode": True}
    assert not {"stream_options", "min_tokens", "n"} & set(pre)
    assert pre["logprobs"] == 2  # the prefill engine checks it against its own --max-logprobs
    params = {"do_remote_prefill": True, "remote_request_id": "x"}
    assert decode_body(body, params) == {**body, "kv_transfer_params": params}
    assert "kv_transfer_params" not in decode_body({**body, "kv_transfer_params": {"a": 1}}, None)
    assert disaggregates(body)
    for extra in ({"n": 2}, {"best_of": 3}, {"use_beam_search": True}, {"prompt_logprobs": 1}):
        assert not disaggregates({**body, **extra}), extra


def test_the_proxys_decode_check_leaves_output_constraints_to_the_prefill_engine():
    """The proxy checks, on its event loop, the fields only the decode engine sees. A schema,
    regex or grammar goes to the prefill engine, which checks it itself (seconds for a large
    schema): the proxy's check leaves it out, so a bad field beside one is still named."""
    from kvserve.disagg.validate import decode_refusal

    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": "{"}}
    bad = ({"structured_outputs": {"regex": "("}}, {"guided_regex": "("}, {"response_format": schema})
    for constraint in bad:
        body = {"model": "m", "prompt": "hi", "max_tokens": 2, "min_tokens": 5, **constraint}
        refused = decode_refusal("/v1/completions", body)
        assert refused is not None and refused["error"]["param"] == "min_tokens", (constraint, refused)
        assert decode_refusal("/v1/completions", {**body, "min_tokens": 1}) is None  # (the prefill's to say)


def test_a_shm_reply_naming_another_file_is_neither_read_nor_removed(tmp_path):
    """A producer's shm reply names the payload file the consumer reads and removes: one that
    names any other file (a rogue or broken peer) fails the pull and leaves the file alone."""
    import threading
    from types import SimpleNamespace

    import msgspec
    import zmq

    from kvserve.kv_transfer.zmq_connector import Reply, ZmqConnector

    victim = tmp_path / "precious"
    victim.write_bytes(b"x" * 8)
    ctx = zmq.Context.instance()
    rogue = ctx.socket(zmq.ROUTER)
    port = rogue.bind_to_random_port("tcp://127.0.0.1")

    def answer() -> None:
        ident, _ = rogue.recv_multipart()
        rogue.send_multipart([ident, msgspec.msgpack.encode(Reply(True, path=str(victim), sizes=[8]))])

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    cfg = parse_kv_transfer_config({"kv_connector": "shm", "kv_role": "kv_consumer"})
    conn = ZmqConnector(cfg, SimpleNamespace(layout="L"), 16)
    req = SimpleNamespace(params=SimpleNamespace(kv_transfer_params=_pull_params("127.0.0.1", port)))
    try:
        with pytest.raises(RuntimeError, match="is not a KV payload file"):
            conn._fetch(req, 0, 1)
    finally:
        t.join(5)
        rogue.close(0)
        conn.shutdown()
    assert victim.read_bytes() == b"x" * 8
