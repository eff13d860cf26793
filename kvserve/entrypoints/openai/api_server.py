"""The FastAPI app: routes, API-key check, OpenAI-shaped errors, and `kvserve serve`."""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Sequence
from contextlib import asynccontextmanager
from typing import Annotated, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve import __version__
from kvserve.batch.app import BatchAPI
from kvserve.config import EngineConfig
from kvserve.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError, RequestRefusedError
from kvserve.engine.core_prespawn import PrespawnedCore
from kvserve.engine.dp_client import DPClient
from kvserve.entrypoints.draining_server import DrainingServer
from kvserve.entrypoints.openai.body_parsing import OffLoopBodyRoute
from kvserve.entrypoints.openai.compat import ModelNotFoundError
from kvserve.entrypoints.openai.errors import (
    error_response,
    field_path,
    param_of,
    specific_error,
    unparsable_body,
    unreadable_body,
    value_error_code,
)
from kvserve.entrypoints.openai.lifecycle import Lifecycle, ServerShuttingDownError
from kvserve.entrypoints.openai.listing import limit_problem
from kvserve.entrypoints.openai.message_count import precheck_body
from kvserve.entrypoints.openai.middleware import BodySizeLimit, HeadAsGet, InternalErrors, RequestGate
from kvserve.entrypoints.openai.openapi import openapi_with_400
from kvserve.entrypoints.openai.pool_check import short_pool_error
from kvserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from kvserve.entrypoints.openai.response_store import ResponseNotFoundError, ResponseStore, open_store
from kvserve.entrypoints.openai.responses import ResponsesServing
from kvserve.entrypoints.openai.responses_items import MAX_LIMIT as MAX_INPUT_ITEMS
from kvserve.entrypoints.openai.responses_items import input_items_page
from kvserve.entrypoints.openai.responses_protocol import Includable, InputTokensRequest, ResponsesRequest
from kvserve.entrypoints.openai.root_path import RootPath
from kvserve.entrypoints.openai.server_config import ServerConfig
from kvserve.entrypoints.openai.serving import ClientDisconnectedError, OpenAIServing, ServerOverloadedError
from kvserve.entrypoints.openai.tools import check_unique_names
from kvserve.metrics.prometheus import ServerMetrics, waiting_prefill_tokens
from kvserve.metrics.vllm_names import vllm_series
from kvserve.web import add_web_ui

logger = logging.getLogger("kvserve.server")

NO_BACKGROUND = "is for background responses (background=true), which this server does not run"
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/reset_prefix_cache")
DRAINED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


def key_matches(header: str, keys: list[str]) -> bool:
    """`Authorization: Bearer <key>` (scheme in any case) against every key, in constant time
    per key, so neither which key nor how much of one matched shows in the timing."""
    scheme, _, token = header.partition(" ")
    token_b = token.strip().encode()
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(token_b, key.encode())
    return ok and scheme.lower() == "bearer"


def detokenize_limit(max_model_len: int) -> tuple[int, str]:
    """/detokenize's own body limit and its 413 message: room for a context's worth of ids (16
    bytes each, whitespace included), at least 1 MiB. Its body is parsed on the event loop, and
    16 MiB of ids (4M) held every stream for half a second."""
    limit = max(2**20, 16 * max_model_len + 2**16)
    message = (
        f"/detokenize takes a body of at most {limit} bytes (room for this model's "
        f"{max_model_len}-token context); send the ids in several requests"
    )
    return limit, message


def engine_dead_response(exc: EngineDeadError) -> Response:
    """503; with Retry-After while the supervisor is restarting the core."""
    resp = error_response(503, str(exc), "engine_dead", code="engine_dead")
    if exc.retry_after is not None:
        resp.headers["Retry-After"] = str(int(exc.retry_after))
    return resp


def build_app(engine: AsyncLLM | DPClient, cfg: ServerConfig, store: ResponseStore | None = None) -> FastAPI:
    names = cfg.served_model_name or [engine.source.name]
    name = names[0]
    if cfg.chat_template is not None:  # every chat path (chat, Responses, /tokenize) renders with it
        engine.tokenizer.hf.chat_template = cfg.chat_template
    metrics = ServerMetrics(name, getattr(engine, "size", 1), engine.config.max_num_seqs)
    metrics.pending_prefill = lambda: waiting_prefill_tokens(engine)
    engine.on_step = metrics.on_step
    engine.on_core_lost = metrics.on_core_lost
    engine.on_abort = metrics.on_abort
    serving = OpenAIServing(
        engine,
        names,
        cfg.request_timeout,
        cfg.max_waiting_requests,
        cfg.stream_stall_timeout,
        cfg.max_logprobs,
    )
    responses = ResponsesServing(serving, store or open_store(cfg.response_store, cfg.response_store_size))
    lifecycle = Lifecycle(engine, cfg.shutdown_timeout)
    # /v1/files, /v1/batches: stops feeding the engine once the server drains
    batch = BatchAPI(serving, cfg, engine.config.max_num_seqs, lambda: lifecycle.draining, responses)
    protected = PROTECTED_PREFIXES + (("/metrics",) if cfg.metrics_require_key else ())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        lifecycle.spawn(lifecycle.warm_up())
        batch.start()
        yield
        await batch.stop()
        serving.close()
        engine.shutdown()

    app = FastAPI(title="kvserve", version=__version__, lifespan=lifespan)
    app.router.route_class = OffLoopBodyRoute  # large JSON bodies parsed in a thread
    app.openapi = lambda: openapi_with_400(app)

    def gate(path: str, headers) -> Response | None:
        if cfg.api_keys and path.startswith(protected):
            if not key_matches(headers.get("authorization", ""), cfg.api_keys):
                return error_response(
                    401, "invalid or missing API key", "authentication_error", code="invalid_api_key"
                )
        if lifecycle.draining and path.startswith(DRAINED_PREFIXES):
            resp = error_response(
                503, "the server is shutting down", "server_shutting_down", code="shutting_down"
            )
            resp.headers["Retry-After"] = "5"
            return resp
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):  # its bytes were reported as "not UTF-8: byte 0x8b ..."
            return error_response(
                415, f"the body is compressed (Content-Encoding: {encoding}), which this server does not "
                "decode; send it uncompressed", code="unsupported_content_encoding",
            )  # fmt: skip
        return None

    app.add_middleware(HeadAsGet)  # innermost: the gate and the request log see HEAD
    app.add_middleware(InternalErrors)  # the gate logs its 500 and adds X-Request-Id
    app.add_middleware(RequestGate, gate=gate)
    # before any parsing
    app.add_middleware(
        BodySizeLimit, max_bytes=cfg.max_request_bytes, overrides=batch.body_limits,
        limits={"/detokenize": detokenize_limit(engine.limits.max_model_len)},
    )  # fmt: skip
    if cfg.allowed_origins:  # outermost: a preflight carries no API key and must not reach the gate
        app.add_middleware(
            CORSMiddleware, allow_origins=cfg.allowed_origins, allow_methods=cfg.allowed_methods,
            allow_headers=cfg.allowed_headers, allow_credentials=cfg.allow_credentials,
            expose_headers=["x-request-id"],
        )  # fmt: skip
    if cfg.root_path:  # outermost of all: every layer above sees the path without the prefix
        app.add_middleware(RootPath, prefix=cfg.root_path)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        first = specific_error(list(exc.errors()))
        body_error = unreadable_body(first, request.headers.get("content-type", ""))
        if body_error:
            return error_response(400, body_error, code="invalid_json")
        loc = list(first.get("loc", []))
        loc = loc[1:] if loc and loc[0] in ("body", "query", "path") else loc  # where, not which field
        param = str(loc[0]) if loc else None  # the top-level field; the message names the path in it
        msg = (
            f"{field_path(loc)}: {first.get('msg', 'invalid value')}"
            if param
            else first.get("msg", "invalid request")
        )
        return error_response(400, msg, param=param, code="invalid_value")

    @app.exception_handler(ValueError)
    async def on_value_error(request: Request, exc: ValueError):
        return error_response(400, str(exc), param=param_of(str(exc)), code=value_error_code(exc))

    @app.exception_handler(ModelNotFoundError)
    async def on_model_not_found(request: Request, exc: ModelNotFoundError):
        return error_response(404, str(exc), param="model", code="model_not_found")

    @app.exception_handler(ResponseNotFoundError)
    async def on_response_not_found(request: Request, exc: ResponseNotFoundError):
        return error_response(404, str(exc), "not_found_error", code="not_found")

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(request: Request, exc: EngineDeadError):
        return engine_dead_response(exc)

    @app.exception_handler(RequestRefusedError)  # (its own: Starlette would pick RequestFailedError's)
    async def on_request_refused(request: Request, exc: RequestRefusedError):
        return error_response(400, str(exc), param=param_of(str(exc)), code="invalid_value")

    @app.exception_handler(RequestFailedError)
    async def on_request_failed(request: Request, exc: RequestFailedError):
        return error_response(500, str(exc), "internal_error", code="engine_error")

    @app.exception_handler(ServerShuttingDownError)
    async def on_shutting_down(request: Request, exc: ServerShuttingDownError):
        resp = error_response(503, str(exc), "server_shutting_down", code="shutting_down")
        resp.headers["Retry-After"] = "5"
        return resp

    @app.exception_handler(ServerOverloadedError)
    async def on_overloaded(request: Request, exc: ServerOverloadedError):
        resp = error_response(503, str(exc), "server_overloaded", code="server_overloaded")
        resp.headers["Retry-After"] = "1"
        return resp

    @app.exception_handler(ClientDisconnectedError)
    async def on_client_gone(request: Request, exc: ClientDisconnectedError):
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"

    @app.exception_handler(TimeoutError)
    async def on_timeout(request: Request, exc: TimeoutError):
        return error_response(504, str(exc), "timeout", code="timeout")

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400 and (body_error := unparsable_body(exc)):
            return error_response(400, body_error, code="invalid_json")
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        message = f"{exc.detail}: {request.method} {request.url.path}"
        resp = error_response(exc.status_code, message, kind, code=code)
        resp.headers.update(exc.headers or {})  # a 405's Allow: RFC 9110 requires it
        return resp

    app.include_router(batch.router)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        return await serving.chat(req, raw)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await serving.completion(req, raw)

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, raw: Request):
        return await serving.embeddings(req, raw)

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, raw: Request):
        return await responses.create(req, raw)

    @app.post("/v1/responses/input_tokens")
    async def count_input_tokens(req: InputTokensRequest):
        return await responses.count_input_tokens(req.as_response_request())

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, stream: bool = False):
        """`stream=true` replays a background response's events at OpenAI: this server runs no
        background responses, and answering JSON to it left the SDK an empty stream, unsaid."""
        found = responses.retrieve(response_id)
        if stream:
            raise ValueError(f"stream: replaying a response's events {NO_BACKGROUND}; GET it without stream")
        return found

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        """OpenAI cancels background responses only; was a 404 naming the route, read as the id's."""
        if response_id in responses.live:
            why = f"close {response_id!r}'s stream to stop it"
            raise ValueError(f"response_id: cancelling {NO_BACKGROUND}; {why}")
        responses.store.get(response_id)
        raise ValueError(
            f"response_id: cancelling {NO_BACKGROUND}; {response_id!r} finished when it was created"
        )

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(
        response_id: str, after: str | None = None, before: str | None = None, limit: int = 20,
        order: Literal["asc", "desc"] = "desc", include: Annotated[list[Includable] | None, Query()] = None,
    ):  # fmt: skip
        """OpenAI's list of the items a stored response was given; `include` asks for fields
        this server has none of (images, search results) or always gives: accepted."""
        if problem := limit_problem(limit, MAX_INPUT_ITEMS):
            return error_response(400, problem[0], param="limit", code=problem[1])
        return input_items_page(responses.input_items(response_id), after, before, limit, order)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        responses.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    created = int(time.time())

    def card(model_id: str) -> dict:
        return {
            "id": model_id, "object": "model", "created": created, "owned_by": "kvserve",
            "root": engine.source.name, "max_model_len": engine.limits.max_model_len,
        }  # fmt: skip

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card(n) for n in names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        serving.check_model(model_id)
        return card(model_id)

    @app.get("/health")
    @app.get("/ping")  # vLLM's (and SageMaker's) name for it; one route a method, so the OpenAPI
    @app.post("/ping")  # document gets an operation id each
    async def health():
        """Liveness: the engine core is running (with replicas: one is; the body lists each)."""
        if isinstance(engine, DPClient):
            body = {"status": "ok" if engine.is_alive else "dead", "replicas": engine.health()}
            return JSONResponse(body, status_code=200 if engine.is_alive else 503)
        if engine.is_alive:
            return Response(status_code=200)
        return engine_dead_response(engine.dead_error())

    @app.get("/health/ready")
    async def health_ready():
        """Readiness: warmed up, the core running, and not draining."""
        if lifecycle.ready:
            return Response(status_code=200)
        why = (
            "draining" if lifecycle.draining else "engine core down" if not engine.is_alive else "warming up"
        )
        return error_response(503, f"not ready: {why}", "not_ready", code="not_ready")

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        if req.messages is not None:
            check_unique_names([t.function for t in req.tools or []], "tools")
            ids = await serving.render_chat(req)  # exactly what the chat request would count
        elif req.tools is not None:
            raise ValueError("tools: only counted with messages")
        else:
            ids = await serving.tokenize_text(req.prompt, req.add_special_tokens)
        body = {"tokens": ids, "count": len(ids), "max_model_len": engine.limits.max_model_len}
        if req.return_token_strs:  # vLLM's: the vocabulary's strings, as convert_ids_to_tokens gives
            body["token_strs"] = serving.tokenizer.hf.convert_ids_to_tokens(ids)
        return body

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        serving.check_model(req.model)
        return {"prompt": await serving.detokenize(req.tokens)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        await engine.reset_prefix_cache()
        return Response(status_code=200)

    @app.get("/metrics")
    async def prom():
        body = metrics.render()
        if cfg.metrics_compat == "vllm":  # the same series under the names vLLM's dashboards read
            body += vllm_series(body)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    if cfg.web_ui:
        add_web_ui(app)
    app.state.engine = engine
    app.state.body_precheck = lambda path, data: precheck_body(path, data, engine.limits.max_model_len)
    app.state.metrics = metrics
    app.state.lifecycle = lifecycle
    return app


def serve(
    config: EngineConfig, host: str, port: int, cfg: ServerConfig, cores: Sequence[PrespawnedCore] = ()
) -> int:
    """Run the server until it is stopped. `cores`: engine core processes already importing,
    one per replica (engine/core_prespawn.py); any missing are spawned as the engines start."""
    import uvicorn

    if not cfg.api_keys and os.environ.get("KVSERVE_API_KEY"):
        cfg.api_keys = [os.environ["KVSERVE_API_KEY"]]
    logger.info("configuration: %s", config)
    shown = {"api_keys": f"{len(cfg.api_keys)} key(s)"}
    if cfg.chat_template:  # its length, not pages of Jinja
        shown["chat_template"] = f"{len(cfg.chat_template)} characters (--chat-template)"
    logger.info("server: %s", {**vars(cfg), **shown})
    requests_level = logging.INFO if cfg.log_requests else logging.WARNING
    logging.getLogger("kvserve.server.requests").setLevel(requests_level)
    store = open_store(
        cfg.response_store, cfg.response_store_size
    )  # a bad spec fails before the engine starts
    if config.data_parallel_size > 1:
        engine = DPClient(
            config, config.data_parallel_size, cfg.routing_policy, restart_limit=cfg.engine_restart_limit,
            prespawned=cores,
        )  # fmt: skip
        logger.info(
            "data parallel: %d replicas, %d thread(s) each, routing %s",
            engine.size, engine.threads_per_replica, engine.policy,
        )  # fmt: skip
    else:
        engine = AsyncLLM(config, restart_limit=cfg.engine_restart_limit, prespawned=next(iter(cores), None))
    # From here the engine runs: whatever fails (building the app included) stops it, or the
    # command printed its error and hung at exit, joining a core that ignores SIGTERM.
    try:
        r = engine.ready
        logger.info(
            "KV pool: %d blocks x %d tokens = %d tokens, %.1f MiB; max concurrency at max_model_len=%d: %.2f",
            r.num_blocks, r.block_size, r.num_blocks * r.block_size, r.kv_cache_bytes / 2**20,
            r.max_model_len, r.num_blocks / -(-r.max_model_len // r.block_size),
        )  # fmt: skip
        problem = short_pool_error(r)
        if problem and config.max_model_len is not None:  # a length asked for: refused, as vLLM
            raise ValueError(problem)
        if problem:  # the model's own context: served (many setups rely on it), and said
            logger.warning("%s; until then a request past the pool is refused", problem)
        app = build_app(engine, cfg, store)
        logger.info(
            "serving %s on %s://%s:%d%s (API key %s)",
            ", ".join(cfg.served_model_name or [engine.source.name]),
            "https" if cfg.ssl_certfile else "http", host, port, cfg.root_path or "",
            "required" if cfg.api_keys else "off",
        )  # fmt: skip
        uv = uvicorn.Config(
            app, host=host, port=port, log_level=cfg.uvicorn_log_level,
            timeout_graceful_shutdown=1, loop="uvloop", http="httptools",
            ssl_keyfile=cfg.ssl_keyfile, ssl_certfile=cfg.ssl_certfile,
        )  # fmt: skip
        DrainingServer(uv, app.state.lifecycle).run()
    finally:
        engine.shutdown()
    return 0
