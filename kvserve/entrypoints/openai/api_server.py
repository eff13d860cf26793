"""The FastAPI app: routes, API-key check, OpenAI-shaped errors, and `kvserve serve`."""

from __future__ import annotations

import logging
import os
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve import __version__
from kvserve.config import EngineConfig
from kvserve.engine.async_llm import AsyncLLM, EngineDeadError
from kvserve.entrypoints.openai.errors import error_response, param_of
from kvserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvserve.entrypoints.openai.serving import ClientDisconnectedError, OpenAIServing, ServerOverloadedError
from kvserve.metrics.prometheus import ServerMetrics

logger = logging.getLogger("kvserve.server")

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/reset_prefix_cache")


def build_app(
    engine: AsyncLLM,
    served_model_name: str,
    api_key: str | None = None,
    request_timeout: float | None = None,
    max_waiting_requests: int | None = None,
) -> FastAPI:
    metrics = ServerMetrics(served_model_name)
    engine.on_step = metrics.on_step
    serving = OpenAIServing(engine, [served_model_name], request_timeout, max_waiting_requests)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield

    app = FastAPI(title="kvserve", version=__version__, lifespan=lifespan)

    @app.middleware("http")
    async def auth_and_log(request: Request, call_next):
        path = request.url.path
        if api_key and path.startswith(PROTECTED_PREFIXES):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return error_response(
                    401, "invalid or missing API key", "authentication_error", code="invalid_api_key"
                )
        t0 = time.monotonic()
        response = await call_next(request)
        if path.startswith("/v1/"):
            logger.info("%s %s %d %.3fs", request.method, path, response.status_code, time.monotonic() - t0)
        return response

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        param = loc[0] if loc else None  # the top-level field; deeper parts name union members
        msg = (
            f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request")
        )
        return error_response(400, msg, param=param, code="invalid_value")

    @app.exception_handler(ValueError)
    async def on_value_error(request: Request, exc: ValueError):
        return error_response(400, str(exc), param=param_of(str(exc)), code="invalid_value")

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(request: Request, exc: EngineDeadError):
        return error_response(503, str(exc), "engine_dead", code="engine_dead")

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
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}", kind)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        return await serving.chat(req, raw)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await serving.completion(req, raw)

    @app.get("/v1/models")
    async def models():
        card = {
            "id": served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "kvserve", "max_model_len": engine.limits.max_model_len,
        }  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        if engine.is_alive:
            return Response(status_code=200)
        return error_response(503, "the engine core is not running", "engine_dead", code="engine_dead")

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        serving.check_model(req.model)
        tok = engine.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        if req.messages is not None:
            msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
            ids = tok.encode(
                tok.apply_chat_template(msgs, req.add_generation_prompt), add_special_tokens=False
            )
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.limits.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        serving.check_model(req.model)
        if any(not 0 <= t < engine.limits.vocab_size for t in req.tokens):
            raise ValueError(f"tokens: ids must be in [0, {engine.limits.vocab_size})")
        return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        await engine.reset_prefix_cache()
        return Response(status_code=200)

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.state.engine = engine
    app.state.metrics = metrics
    return app


def serve(config: EngineConfig, host: str, port: int, served_model_name: str | None, api_key: str | None,
          request_timeout: float | None, max_waiting_requests: int | None = None) -> int:  # fmt: skip
    import uvicorn

    api_key = api_key or os.environ.get("KVSERVE_API_KEY") or None
    logger.info("configuration: %s", config)
    engine = AsyncLLM(config)
    r = engine.ready
    logger.info(
        "KV pool: %d blocks x %d tokens = %d tokens, %.1f MiB; max concurrency at max_model_len=%d: %.2f",
        r.num_blocks, r.block_size, r.num_blocks * r.block_size, r.kv_cache_bytes / 2**20, r.max_model_len,
        r.num_blocks / -(-r.max_model_len // r.block_size),
    )  # fmt: skip
    name = served_model_name or engine.source.name
    app = build_app(engine, name, api_key, request_timeout, max_waiting_requests)
    logger.info("serving %s on http://%s:%d (API key %s)", name, host, port, "required" if api_key else "off")
    try:
        uvicorn.run(
            app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=2, loop="uvloop",
            http="httptools",
        )  # fmt: skip
    finally:
        engine.shutdown()
    return 0
