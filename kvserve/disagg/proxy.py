"""The prefill/decode proxy: each request goes to a prefill engine (max_tokens 1, keep the KV)
and then, with the returned transfer parameters, to a decode engine whose answer is passed
through to the client (SSE event for event when streaming).

Failure semantics (disagg/prefill.py): a prefill engine that errors, times out or answers without parameters
only costs time: the decode engine is asked without them and computes the prompt itself
(`x-kvserve-pd: fallback` on the response). A client that goes away during the prefill
cancels it (the prefill engine aborts the request); during the decode, streamed or not, the
closed decode request aborts it on the decode engine, which releases the producer's lease.
A lease no decode engine will pull (the client left after the prefill, every decode engine
failed, one refused the parameters) is released by the proxy at once (lease.py).
The Responses API and embeddings go whole to a decode engine (whole.py).

SIGTERM drains as `kvserve gateway` and `kvserve serve` do (routing/drain.py): /health/ready
turns 503, new requests get 503 + Retry-After, those in flight may finish until
--shutdown-timeout; then a stream still running gets an error event (`shutting_down`) and
[DONE], a request still waiting a 503, and the process exits.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from urllib.parse import quote

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvserve.disagg.decode import decode
from kvserve.disagg.errors import error as _error
from kvserve.disagg.lease import release_lease
from kvserve.disagg.passthrough import add_engine_routes, first_decode
from kvserve.disagg.passthrough import up as engine_up
from kvserve.disagg.prefill import PrefillResult, refuses_transfer, run_prefill
from kvserve.disagg.split import decode_body, disaggregates
from kvserve.disagg.validate import decode_refusal
from kvserve.disagg.whole import StoredResponses, engine_tag
from kvserve.entrypoints.draining_server import DrainingServer
from kvserve.entrypoints.openai.middleware import _REQUEST_ID, BodySizeLimit, HeadAsGet, InternalErrors
from kvserve.routing.drain import ENDING_S, DrainLifecycle
from kvserve.routing.in_flight import RETRY_AFTER, InFlight
from kvserve.routing.json_type import not_json
from kvserve.routing.responses_ids import previous_id_problem
from kvserve.routing.settled_stream import SettledStream

logger = logging.getLogger(__name__)
ROUTES = ("/v1/chat/completions", "/v1/completions")
RESPONSES, EMBEDDINGS = "/v1/responses", "/v1/embeddings"  # whole to a decode engine (whole.py)
# a Responses prompt counted (no id in its answer), where previous_response_id's engine holds it
INPUT_TOKENS = "/v1/responses/input_tokens"
PINNED = (RESPONSES, INPUT_TOKENS)  # previous_response_id goes to the engine its id names
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20  # as kvserve serve's and the gateway's
DEFAULT_PREFILL_TIMEOUT = 60.0  # as the gateway's first_byte_timeout
DEFAULT_DECODE_FIRST_BYTE_TIMEOUT = 60.0  # a stream's first event (the gateway's first_byte_timeout)
DEFAULT_SHUTDOWN_TIMEOUT = 30.0  # as the gateway's and kvserve serve's


class PDProxy:
    def __init__(
        self, prefill: list[str], decode: list[str], timeout_s: float = 600.0,
        prefill_timeout_s: float = DEFAULT_PREFILL_TIMEOUT,
        decode_first_byte_timeout_s: float = DEFAULT_DECODE_FIRST_BYTE_TIMEOUT,
        shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT,
    ) -> None:  # fmt: skip
        if not prefill or not decode:
            raise ValueError("pd-proxy: needs at least one --prefill and one --decode URL")
        self.prefill = [_base_url("--prefill", u) for u in prefill]
        self.decode = [_base_url("--decode", u) for u in decode]
        self.stored = StoredResponses(self.decode)
        self._next_prefill = self._next_decode = 0
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))
        self.num_fallbacks = 0
        self.prefill_timeout_s = prefill_timeout_s  # a hung prefill engine costs this, then a fallback
        self.decode_first_byte_timeout_s = decode_first_byte_timeout_s  # then the next decode engine
        self.num_in_flight = 0  # model requests not yet answered (streams until they end): the drain waits
        self.in_flight = InFlight("the pd-proxy", "--shutdown-timeout")  # what the drain's deadline ends
        self.lifecycle = DrainLifecycle(
            shutdown_timeout_s, lambda: self.num_in_flight, self.in_flight.close, logger
        )

    @staticmethod
    def _headers(raw: Request) -> dict:
        """The client's headers the engines need, as the bytes that came (httpx encodes a str as
        ASCII: a Latin-1 byte in a key raised)."""
        keep = (b"authorization", b"x-request-id")
        return {k: v for k, v in raw.headers.raw if k.lower() in keep}

    @classmethod
    def _engine_headers(cls, raw: Request) -> tuple[dict, str]:
        """The headers for both engines, with one X-Request-Id (the client's usable one, else a
        new one), and that id: each engine made its own before, so the two halves of a request
        could not be found together in their logs, and the client got neither."""
        rid = raw.headers.get("x-request-id", "")
        rid = rid if _REQUEST_ID.fullmatch(rid) else uuid.uuid4().hex
        headers = {k: v for k, v in cls._headers(raw).items() if k.lower() != b"x-request-id"}
        return {**headers, b"x-request-id": rid.encode()}, rid

    async def _prefill_any(self, path: str, body: dict, headers: dict) -> PrefillResult:
        """The first prefill engine's answer that is not a failure (the engines in turn, each
        request starting at the next); after all failed, the decode engine computes the prompt."""
        i, self._next_prefill = self._next_prefill, (self._next_prefill + 1) % len(self.prefill)
        for url in self.prefill[i:] + self.prefill[:i]:
            result = await run_prefill(self.client, url + path, body, headers, self.prefill_timeout_s)
            if not result.failed:
                return result
        logger.warning("no prefill engine answered; the decode engine computes the prompt")
        return result

    async def _prefill(self, path: str, body: dict, raw: Request, send: dict) -> PrefillResult | None:
        """The prefill engines' answer; None if the client left meanwhile (it is cancelled)."""
        call = asyncio.ensure_future(self._prefill_any(path, body, send))
        while not call.done():
            try:
                await asyncio.wait([call], timeout=0.5)
            except BaseException:  # (the drain's deadline): the prefill engine aborts it too
                call.cancel()
                raise
            if not call.done() and await raw.is_disconnected():
                call.cancel()  # closes the connection: the prefill engine aborts the request
                await asyncio.gather(call, return_exceptions=True)
                if call.done() and not call.cancelled():  # (answered first: its lease is nobody's)
                    release_lease(call.result().params)
                return None
        return call.result()

    async def handle(self, path: str, raw: Request) -> Response:
        """The request's answer, which carries its X-Request-Id however it ends (the proxy's own
        refusals and a prefill engine's 4xx had none: the client could not name the request the
        engines' logs hold)."""
        send, rid = self._engine_headers(raw)
        resp = self._shutting_down() if self.lifecycle.draining else await self._counted(path, raw, send, rid)
        if "x-request-id" not in resp.headers:
            resp.headers["x-request-id"] = rid
        return resp

    def _shutting_down(self) -> Response:
        """503 while draining (kvserve serve's answer): another replica, or this one restarted."""
        err = _error(self.in_flight.message if self.in_flight.closing else "the pd-proxy is shutting down",
                     None, "server_error", "shutting_down")  # fmt: skip
        return JSONResponse(err, status_code=503, headers={"retry-after": RETRY_AFTER})

    async def _counted(self, path: str, raw: Request, send: dict, rid: str) -> Response:
        """The answer, counted in flight until it ends (a stream: until its last byte) for the drain;
        at the drain's deadline a request still waiting for its answer is a 503."""
        self.num_in_flight += 1
        ended = False

        async def end() -> None:
            nonlocal ended
            if not ended:
                ended, self.num_in_flight = True, self.num_in_flight - 1

        work = asyncio.ensure_future(self._handle(path, raw, send, rid))
        self.in_flight.waiting(work)
        try:
            await asyncio.wait({work})
            if work.cancelled() and self.in_flight.closing:
                await end()
                return self._shutting_down()
            resp = work.result()
        except BaseException:
            work.cancel()
            await end()
            raise
        if not isinstance(resp, StreamingResponse):
            await end()
            return resp
        inner = resp.on_close if isinstance(resp, SettledStream) else None  # (the decode request's close)

        async def settle() -> None:
            try:
                if inner is not None:
                    await inner()
            finally:
                await end()

        return SettledStream(resp.body_iterator, settle, status_code=resp.status_code, headers=resp.headers)

    async def _handle(self, path: str, raw: Request, send: dict, rid: str) -> Response:
        if (why := not_json(raw.headers.get("content-type"))) is not None:  # (curl -d: a form's)
            return JSONResponse(_error(why, None), status_code=400)
        try:
            body = await raw.json()
        except ValueError:
            return JSONResponse(_error("request body: not valid JSON", None), status_code=400)
        except RecursionError:  # the client's mistake, not the proxy's: no 500, no traceback
            msg = "request body: not valid JSON (arrays or objects nested too deeply)"
            return JSONResponse(_error(msg, None), status_code=400)
        if not isinstance(body, dict):
            return JSONResponse(_error("request body: must be a JSON object", None), status_code=400)
        params, how, urls = None, "decode-only", None
        if path in PINNED and (wrong := previous_id_problem(body.get("previous_response_id"))):
            return JSONResponse(_error(wrong, "previous_response_id", code="invalid_value"), 400)
        if path in PINNED and body.get("previous_response_id") is not None:
            where = self.stored.where(body["previous_response_id"])
            if where is None:
                return self.stored.previous_not_found(body["previous_response_id"])
            urls, body = [where[0]], dict(body, previous_response_id=where[1])  # where it is stored
        if path in ROUTES and disaggregates(body):
            refused = decode_refusal(path, body)
            if refused is not None:  # (prefilled, its KV would be leased for a decode that refuses it)
                return JSONResponse(refused, status_code=400)
            pre = await self._prefill(path, body, raw, send)
            if pre is None:
                return Response(status_code=499)
            if await raw.is_disconnected():  # gone after the prefill: no decode engine will pull it
                release_lease(pre.params)
                return Response(status_code=499)
            if pre.refused_status is not None:  # the client's mistake: the prefill engine's 4xx stands
                status, content = pre.refused_status, pre.refused_content
                return Response(content, status_code=status, media_type="application/json")
            params = pre.params
            how = "disaggregated" if params else "fallback"
            self.num_fallbacks += params is None
        headers = {"x-kvserve-pd": how, "x-request-id": rid}
        work = asyncio.ensure_future(self._decode(path, body, params, send, headers, urls))
        gone = asyncio.ensure_future(_disconnected(raw))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            work.cancel()
            release_lease(params)  # (the drain's deadline: a decode engine's abort releases it too)
            raise
        finally:
            gone.cancel()
        if work.done():
            resp = work.result()
            if resp.status_code >= 500:  # no decode engine answered (decode.py): none will pull it
                release_lease(params)
            return resp
        work.cancel()  # the client left before the answer: closing the request aborts the decode
        await asyncio.gather(work, return_exceptions=True)
        release_lease(params)  # (also when no decode engine had it yet; a pulled one is a no-op)
        return Response(status_code=499)

    def _decode_order(self) -> list[str]:
        """Every decode engine, each request starting at the next (round robin)."""
        i, self._next_decode = self._next_decode, (self._next_decode + 1) % len(self.decode)
        return self.decode[i:] + self.decode[:i]

    async def _decode(
        self, path: str, body: dict, params: dict | None, send: dict, headers: dict, urls: list[str] | None
    ) -> Response:
        """The decode engines' answer; one refusing the producer's parameters (not a producer it
        pulls from: set up wrong) is asked again without them, and computes the prompt."""
        stream = bool(body.get("stream"))
        resp = await self._decode_once(path, decode_body(body, params), stream, send, headers, urls)
        if params and refuses_transfer(resp.status_code, getattr(resp, "body", b"")):
            logger.warning("a decode engine refused the producer's kv_transfer_params: it computes it")
            release_lease(params)
            self.num_fallbacks += 1
            headers = {**headers, "x-kvserve-pd": "fallback"}
            resp = await self._decode_once(path, decode_body(body, None), stream, send, headers, urls)
        return resp

    async def _decode_once(
        self, path: str, body: dict, stream: bool, send: dict, headers: dict, urls: list[str] | None
    ) -> Response:
        return await decode(
            self.client, urls or self._decode_order(), path, body, stream, send, headers,
            self.decode_first_byte_timeout_s, engine_tag if path == RESPONSES else None, self.in_flight,
        )  # fmt: skip

    async def aclose(self) -> None:
        await self.client.aclose()


def _base_url(flag: str, url: str) -> str:
    """A server's root URL. One given with /v1 (as the gateway's base_url and prefill_url are
    written) is taken without it: the proxy adds /v1/... itself, and /v1/v1/... was a 404 the
    client got as its own error."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{flag}: {url!r} must start with http:// or https://")
    return url.rstrip("/").removesuffix("/v1")


async def _disconnected(raw: Request) -> None:
    """Returns when the client has gone away (its body is read: only a disconnect can come)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def build_app(proxy: PDProxy, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    app = FastAPI(title="kvserve pd-proxy")
    app.state.proxy = proxy
    app.add_middleware(HeadAsGet)  # monitors probe /health with HEAD (was a 405: taken out as down)
    # an exception no handler took is the proxy's bug: a 500 in OpenAI's shape, the trace logged
    # once (was Starlette's text/plain 'Internal Server Error' and uvicorn's traceback)
    app.add_middleware(InternalErrors)
    # bodies are read whole: without a bound one client's upload takes the memory (413 first)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)

    @app.exception_handler(ClientDisconnect)
    async def client_left(raw: Request, _: ClientDisconnect) -> Response:
        """The client went away before its body arrived: its doing, not a traceback in our log."""
        logger.info("%s %s: the client left while sending its body (499)", raw.method, raw.url.path)
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(raw: Request, e: StarletteHTTPException) -> Response:
        """An unknown path or method: OpenAI's shape (was FastAPI's {"detail": ...})."""
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "invalid_request")
        err = _error(f"{e.detail}: {raw.method} {raw.url.path}", None, code=code)
        return JSONResponse(err, status_code=e.status_code, headers=getattr(e, "headers", None))

    # (INPUT_TOKENS: its path is also GET / DELETE /v1/responses/{id}'s, which answered POST a 405)
    for path in (*ROUTES, RESPONSES, INPUT_TOKENS, EMBEDDINGS):

        async def route(raw: Request, _path: str = path) -> Response:
            return await proxy.handle(_path, raw)

        app.add_api_route(path, route, methods=["POST"])

    @app.get("/v1/responses/{response_id}")
    @app.delete("/v1/responses/{response_id}")
    async def stored(raw: Request, response_id: str) -> Response:
        """A stored response, on the decode engine that answered it (its id names it)."""
        headers = proxy._headers(raw)
        return await proxy.stored.request(proxy.client, raw.method, response_id, raw.url.query, headers)

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(raw: Request, response_id: str) -> Response:
        headers = proxy._headers(raw)
        return await proxy.stored.request(
            proxy.client, raw.method, response_id, raw.url.query, headers, "/input_items"
        )

    @app.get("/v1/models")
    @app.get("/v1/models/{model_id:path}")  # OpenAI's models.retrieve (was a route 404)
    async def models(raw: Request) -> Response:
        """The first decode engine that answers says (not one restarting: passthrough.py)."""
        return await first_decode(proxy, raw, quote(raw.url.path))  # (a model id may hold a slash)

    @app.get("/health/liveliness")  # the gateway's (LiteLLM's) liveness paths: /health is 503
    @app.get("/health/liveness")  # while no decode engine answers, and a liveness probe on it
    async def liveness() -> dict:  # restarted a healthy proxy whose engines were still loading
        """Liveness: the process answers (its engines being down is readiness's business)."""
        return {"status": "ok"}

    @app.get("/health")
    @app.get("/ping")  # vLLM's (and SageMaker's) name for it, as kvserve serve answers it
    @app.post("/ping")
    async def health() -> Response:
        states = await asyncio.gather(*(engine_up(proxy, u, "/health") for u in proxy.prefill + proxy.decode))
        # one decode engine answering is enough: the others are tried in turn, and without a prefill
        # engine the decode engine computes the prompt (slower, still an answer)
        up = any(states[len(proxy.prefill) :])
        return JSONResponse({"prefill": states[: len(proxy.prefill)], "decode": states[len(proxy.prefill) :]},
                            status_code=200 if up else 503)  # fmt: skip

    add_engine_routes(app, proxy)  # /tokenize, /detokenize, /version, /health/ready, cancel

    @app.on_event("shutdown")
    async def close() -> None:
        await proxy.aclose()

    return app


def serve(
    prefill: list[str], decode: list[str], host: str, port: int,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, prefill_timeout_s: float = DEFAULT_PREFILL_TIMEOUT,
    decode_first_byte_timeout_s: float = DEFAULT_DECODE_FIRST_BYTE_TIMEOUT,
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT,
) -> int:  # fmt: skip
    import uvicorn

    proxy = PDProxy(prefill, decode, prefill_timeout_s=prefill_timeout_s,
                    decode_first_byte_timeout_s=decode_first_byte_timeout_s,
                    shutdown_timeout_s=shutdown_timeout_s)  # fmt: skip
    logger.info("pd-proxy on %s:%d: prefill %s, decode %s", host, port, proxy.prefill, proxy.decode)
    uv = uvicorn.Config(build_app(proxy, max_request_bytes), host=host, port=port, log_level="warning",
                        access_log=False, timeout_graceful_shutdown=ENDING_S)  # fmt: skip
    DrainingServer(uv, proxy.lifecycle).run()  # SIGTERM: the drain (routing/drain.py)
    return 0
