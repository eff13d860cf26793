"""The gateway's FastAPI app: OpenAI routes, health, readiness, metrics and the admin API."""

from __future__ import annotations

import contextlib
import hmac
import logging
import sqlite3

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvserve.entrypoints.draining_server import DrainingServer
from kvserve.entrypoints.openai.middleware import BodySizeLimit, HeadAsGet, InternalErrors
from kvserve.gateway.admin import admin_router
from kvserve.gateway.auth_headers import HOW, presented_key
from kvserve.gateway.backends import BackendPool
from kvserve.gateway.batch_routes import add_batch_routes
from kvserve.gateway.batches import BatchAPI
from kvserve.gateway.config import ConfigError, GatewayConfig
from kvserve.gateway.errors import GatewayError, unauthorized
from kvserve.gateway.handler import Gateway
from kvserve.gateway.input_tokens import count_input_tokens
from kvserve.gateway.keys import KeyRecord, KeyStore, expired_words, hash_key, open_database
from kvserve.gateway.litellm_key_block import BLOCKED, litellm_key_block_router
from kvserve.gateway.litellm_key_regenerate import litellm_key_regenerate_router
from kvserve.gateway.litellm_keys import litellm_key_router
from kvserve.gateway.litellm_spend import litellm_spend_router
from kvserve.gateway.litellm_teams import litellm_team_router
from kvserve.gateway.litellm_users import litellm_user_router
from kvserve.gateway.metrics import GatewayMetrics
from kvserve.gateway.model_health import model_health
from kvserve.gateway.model_info import add_model_info_routes
from kvserve.gateway.readiness import answer, readiness
from kvserve.gateway.spend import SpendLog
from kvserve.gateway.state import StoreUnavailable, open_store, same_redis_server
from kvserve.gateway.stored_responses import stored_response
from kvserve.gateway.users import UserStore
from kvserve.routing.drain import ENDING_S, DrainLifecycle
from kvserve.routing.in_flight import RETRY_AFTER
from kvserve.web import add_web_ui

log = logging.getLogger("kvserve.gateway")
# what a page may read of an answer besides the CORS-safelisted headers: the request's id, the
# rate-limit window, when to retry, who answered
_EXPOSED = ["x-request-id", "retry-after", "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
            "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-kvserve-deployment",
            "x-kvserve-model-group", "x-kvserve-attempts", "x-litellm-response-cost",
            "x-litellm-model-group", "x-litellm-model-id"]  # fmt: skip


class GatewayState:
    """What the routes share: store, keys, spend log, connection pools, metrics."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        gs = cfg.general_settings
        rc = cfg.response_cache
        cache_bytes = rc.max_bytes if rc is not None else None
        try:  # a path or URL that cannot be opened: one line naming the setting, not a traceback
            self.store = open_store(gs.state, cache_bytes)
        except ValueError as e:
            raise ConfigError(f"general_settings.state: {e}") from None
        self.cache_store = self.store
        if rc is not None and rc.store is not None and rc.store != gs.state:
            try:
                self.cache_store = open_store(rc.store, cache_bytes)
            except ValueError as e:
                raise ConfigError(f"response_cache.store: {e}") from None
        if rc is not None and same_redis_server(gs.state, rc.store or gs.state):
            log.warning(
                "response_cache shares the state store's Redis server: under maxmemory its answers can "
                "evict rate-limit windows, or fill it; give it a Redis of its own (response_cache.store; "
                "another db number on the same server shares its memory)"
            )
        try:
            shared = None
            if gs.state != "memory":  # Redis: keys every instance sees (shared_keys.py)
                from kvserve.gateway.shared_keys import SharedKeys

                shared = SharedKeys(self.store.redis)
            self.keys = KeyStore(cfg, open_database(gs.database), shared)
            self.spend = SpendLog(open_database(gs.database))
            # users (LiteLLM's /user/*): in Redis beside the keys, else in the database
            self.users = UserStore(open_database(gs.database), shared.redis if shared else None)
            self.keys.users = self.users
        except sqlite3.Error as e:
            raise ConfigError(f"general_settings.database: {gs.database}: {e}") from None
        self.pool = BackendPool(cfg)
        self.metrics = GatewayMetrics()
        self.gateway = Gateway(cfg, self.store, self.pool, self.spend, self.metrics, self.cache_store)
        self.lifecycle = DrainLifecycle(  # SIGTERM: /health/ready false, then the drain (routing/drain.py)
            cfg.general_settings.shutdown_timeout,
            lambda: self.gateway.num_in_flight,
            self.gateway.in_flight.close,
            log,
        )

    def refuse_if_draining(self) -> None:
        if self.lifecycle.draining:
            retry = {"retry-after": RETRY_AFTER}
            raise GatewayError(
                503, "the gateway is shutting down", "server_error", "shutting_down", headers=retry
            )

    async def authenticate(self, request: Request) -> KeyRecord:
        token = presented_key(request.headers)
        if token is None:
            raise unauthorized(f"Authorization: missing; {HOW}")
        rec = await self.keys.record_async(hash_key(token))
        if rec is None:
            raise unauthorized("Authorization: unknown or revoked key")
        if rec.expired:  # (LiteLLM's words: a user told "unknown, revoked or expired" could not tell which)
            raise unauthorized(expired_words(rec))
        if rec.spec.blocked:  # (LiteLLM's words: its users' scripts and runbooks look for them)
            raise unauthorized(BLOCKED)
        return rec

    def require_master(self, request: Request) -> None:
        master = self.cfg.general_settings.master_key
        if not master:
            raise GatewayError(
                403, "admin API: disabled (no general_settings.master_key)", "permission_denied"
            )
        token = presented_key(request.headers) or ""
        if not hmac.compare_digest(token.encode(), master.encode()):
            raise unauthorized("Authorization: the admin API needs the master key")


def build_app(cfg: GatewayConfig, web_ui: bool = True) -> FastAPI:
    state = GatewayState(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.spend.start()
        state.gateway.monitor.start()
        yield
        await state.gateway.monitor.stop()
        await state.spend.stop()
        await state.pool.close()
        await state.store.close()
        if state.cache_store is not state.store:
            await state.cache_store.close()

    app = FastAPI(title="kvserve gateway", lifespan=lifespan)
    app.state.gateway = state
    # an exception no handler took is the gateway's bug: a 500 in OpenAI's shape, the trace
    # logged once (Starlette's was text/plain, with uvicorn's trace, and the connection closed)
    app.add_middleware(HeadAsGet)  # monitors probe /health with HEAD (middleware.py)
    app.add_middleware(InternalErrors)
    # the handler reads whole bodies: without a bound one client's upload takes the memory
    app.add_middleware(BodySizeLimit, max_bytes=cfg.general_settings.max_request_bytes)
    if cfg.general_settings.allowed_origins:  # outermost: a preflight is answered before the rest
        app.add_middleware(CORSMiddleware, allow_origins=cfg.general_settings.allowed_origins,
                           allow_methods=["*"], allow_headers=["*"], expose_headers=_EXPOSED)  # fmt: skip
    app.include_router(admin_router(state))
    app.include_router(litellm_key_router(state))  # LiteLLM's /key/* paths over the same keys
    app.include_router(litellm_key_block_router(state))  # LiteLLM's /key/block, /key/unblock
    app.include_router(litellm_key_regenerate_router(state))  # LiteLLM's /key/regenerate
    app.include_router(litellm_spend_router(state))  # LiteLLM's /spend/logs, /global/spend
    app.include_router(litellm_team_router(state))  # LiteLLM's /team/info, /team/list (config teams)
    app.include_router(litellm_user_router(state))  # LiteLLM's /user/new, /info, /update, /delete

    def st() -> GatewayState:
        return state

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, e: GatewayError):
        return e.response()

    @app.exception_handler(StoreUnavailable)
    async def _store_down(_: Request, e: StoreUnavailable):
        log.warning("%s", e)
        return GatewayError(503, str(e), "server_error", "state_store_unavailable").response()

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, _: ClientDisconnect):
        """The client went away before its body arrived: its doing, not a traceback in our log."""
        log.info("%s %s: the client left while sending its body (499)", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"][1:]) or "body"
        param = loc if loc != "body" else None  # (a query parameter's name, as OpenAI's param)
        return GatewayError(400, f"{loc}: {err['msg']}", code="invalid_value", param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        """An unknown path or method in OpenAI's shape, with Starlette's headers: a 405's `Allow`
        (RFC 9110 requires it; it was dropped, so a client could not tell which method to use)."""
        message = f"{e.detail}: {request.method} {request.url.path}"
        return GatewayError(e.status_code, message, headers=dict(e.headers or {})).response()

    async def forward(request: Request, path: str, model: str | None = None):
        """A model request (the routes below): refused while draining, else the key's, routed."""
        s = st()
        s.refuse_if_draining()
        return await s.gateway.handle(request, path, await s.authenticate(request), model)

    # Azure OpenAI's paths, as LiteLLM's proxy serves them: its SDK (AzureOpenAI with
    # azure_endpoint at the gateway, the key in `api-key`, read already) names the model as the
    # deployment in the path and sends ?api-version=; each of its requests was a route 404
    for base in ("/openai/deployments/{model}", "/engines/{model}"):
        for tail in ("/chat/completions", "/completions", "/embeddings"):

            async def azure(request: Request, model: str, _tail: str = tail):
                return await forward(request, _tail, model)

            app.add_api_route(base + tail, azure, methods=["POST"], include_in_schema=False)

    # each OpenAI route also without /v1, as LiteLLM's proxy serves them: its users' clients are
    # set up with base_url http://host:4000, and every request of theirs was a 404 here
    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat(request: Request):
        return await forward(request, "/chat/completions")

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: Request):
        return await forward(request, "/completions")

    @app.post("/v1/responses")
    @app.post("/responses")
    async def responses(request: Request):
        return await forward(request, "/responses")

    @app.post("/v1/responses/input_tokens")
    @app.post("/responses/input_tokens")
    async def input_tokens(request: Request):
        """OpenAI's responses.input_tokens.count (input_tokens.py; was a 405: the path is also
        GET / DELETE /v1/responses/{id}'s)."""
        s = st()
        s.refuse_if_draining()
        return await count_input_tokens(s.gateway, await s.authenticate(request), request)

    async def on_stored(request: Request, response_id: str, tail: str = "") -> Response:
        s = st()
        s.refuse_if_draining()
        key = await s.authenticate(request)
        return await stored_response(s.gateway, key, request.method, response_id, request.url.query, tail)

    @app.get("/v1/responses/{response_id}")
    @app.delete("/v1/responses/{response_id}")
    @app.get("/responses/{response_id}")
    @app.delete("/responses/{response_id}")
    async def stored(request: Request, response_id: str):
        return await on_stored(request, response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    @app.get("/responses/{response_id}/input_items")
    async def input_items(request: Request, response_id: str):
        return await on_stored(request, response_id, "/input_items")

    @app.post("/v1/responses/{response_id}/cancel")
    @app.post("/responses/{response_id}/cancel")
    async def cancel(request: Request, response_id: str):
        """OpenAI's responses.cancel, on the deployment holding it (was a route 404, which the
        client read as the id's)."""
        return await on_stored(request, response_id, "/cancel")

    def model_card(alias: str) -> dict:
        return {"id": alias, "object": "model", "created": 0, "owned_by": "kvserve-gateway"}

    @app.post("/v1/embeddings")
    @app.post("/embeddings")
    async def embeddings(request: Request):
        return await forward(request, "/embeddings")

    @app.get("/v1/models")
    @app.get("/models")
    async def models(request: Request):
        s = st()
        names = s.gateway.callable_names(await s.authenticate(request))
        hidden = {a for a, e in cfg.router_settings.model_group_alias.items() if e.hidden}
        return {"object": "list", "data": [model_card(a) for a in names if a not in hidden]}

    @app.get("/v1/models/{model_id:path}")
    @app.get("/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        """OpenAI's models.retrieve (was a route 404); an alias this key may not use is not found."""
        s = st()
        if model_id not in s.gateway.callable_names(await s.authenticate(request)):
            raise GatewayError(
                404, f"model: {model_id!r} does not exist", code="model_not_found", param="model"
            )
        return model_card(model_id)

    async def admit(request: Request) -> KeyRecord:
        s = st()
        s.refuse_if_draining()
        return await s.authenticate(request)

    add_batch_routes(app, BatchAPI(state.gateway, state.keys), admit)  # the Batch API (batches.py)
    add_model_info_routes(app, state)  # LiteLLM's /model/info

    @app.get("/health/liveliness")  # LiteLLM's probe paths: its charts' liveness probes got 404s,
    @app.get("/health/liveness")  # and a pod answering 404 to its probe is restarted in a loop
    async def liveness():
        """Liveness: the process answers (a backend being down is readiness's business)."""
        return {"status": "ok"}

    @app.get("/health")
    async def health(request: Request, model: str | None = None):
        """Without a key, liveness (probes send none); with one, LiteLLM's health of the
        deployments that key may call (model_health.py)."""
        if presented_key(request.headers) is None:
            return {"status": "ok"}
        s = st()
        return await model_health(s.gateway, await s.authenticate(request), model)

    @app.get("/health/ready")
    @app.get("/health/readiness")  # the earlier name, kept
    async def ready():
        """Readiness: not draining, the state store answers, one deployment is up and warm."""
        s = st()
        if s.lifecycle.draining:
            return JSONResponse(answer(False, None, [], reason="draining"), status_code=503)
        ok, body = await readiness(s.pool, s.store, cfg.model_list)  # (readiness.py: a deadline)
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(st().metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if web_ui:  # the chat over the aliases (/v1/models), the dashboard over the gateway's metrics
        add_web_ui(app)
    return app


def serve(cfg: GatewayConfig, host: str, port: int, web_ui: bool = True) -> int:
    import uvicorn

    app = build_app(cfg, web_ui)  # raises ConfigError for a database or state URL it cannot open
    log.info(
        "kvserve gateway on http://%s:%d: %d deployments, state %s",
        host,
        port,
        len(cfg.model_list),
        cfg.general_settings.state.split("@")[-1],
    )
    uv = uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, timeout_graceful_shutdown=ENDING_S
    )
    DrainingServer(uv, app.state.gateway.lifecycle).run()
    return 0
