"""ASGI middleware that runs before any parsing: the request-size limit and the gate; and
around the routes, the answer to an exception no handler took.

A body over `max_bytes` is answered 413 without being read into memory or parsed: at once
when Content-Length says so, or as soon as a chunked body grows past the limit.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("kvserve.server")
# the line each API request logs: a logger of its own, which --disable-log-requests silences
request_log = logging.getLogger("kvserve.server.requests")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def _error_body(message: str, code: str, type_: str = "invalid_request_error") -> bytes:
    error = {"message": message, "type": type_, "param": None, "code": code}
    return json.dumps({"error": error}).encode()


async def _send_json(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_413(send: Send, max_bytes: int, message: str | None = None) -> None:
    message = message or f"request body is larger than the server's limit of {max_bytes} bytes"
    await _send_json(send, 413, _error_body(message, "request_too_large"))


class InternalErrors:
    """An exception no handler took is kvserve's bug, not the client's: the client gets
    OpenAI's error shape with a 500, and the trace is logged once. Left to Starlette, the answer
    is plain text and uvicorn then drops the keep-alive connection, so the client's next request
    on it fails too. An exception after the response started still ends the connection: the
    body already sent cannot be taken back."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def noting_start(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, noting_start)
        except Exception:
            if started:
                raise
            logger.exception("internal error answering %s %s", scope.get("method"), scope["path"])
            body = _error_body("internal server error (the server log has the details)", "internal_error",
                               "internal_error")  # fmt: skip
            await _send_json(send, 500, body)


class HeadAsGet:
    """HEAD is answered as GET would be, without the body: uptime monitors and load balancers
    probe `/health` and `/v1/models` with HEAD, and FastAPI's routes take only the methods
    they name (405 before). The GET's headers go out as they are (Content-Length included, as
    HTTP has it for HEAD); routes without GET still answer 405."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)
        ended = False

        async def headers_only(message: Message) -> None:
            nonlocal ended
            if message["type"] != "http.response.body":
                await send(message)
            elif not ended:  # one empty body ends the response; the rest of the GET's is dropped
                ended = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})

        await self.app({**scope, "method": "GET"}, receive, headers_only)


class BodySizeLimit:
    """`overrides` gives some paths their own limit for chunked bodies; a declared length there
    is left to the route, which refuses it naming its field (file uploads). `limits` gives some
    paths a lower limit for every body, with the 413's message: a route whose body is parsed on
    the event loop and has no use for 16 MiB (/detokenize)."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        overrides: dict[str, int] | None = None,
        limits: dict[str, tuple[int, str]] | None = None,
        message: str | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.overrides = overrides or {}
        self.limits = limits or {}
        self.message = message

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        limit = self.overrides.get(scope["path"])
        if limit is not None:
            if length is not None:
                return await self.app(scope, receive, send)
            return await BodySizeLimit(self.app, limit)(scope, receive, send)
        own, says = self.limits.get(scope["path"], (self.max_bytes, None))
        if own < self.max_bytes:
            return await BodySizeLimit(self.app, own, message=says)(scope, receive, send)
        if length is not None:
            if not length.isdigit() or int(length) > self.max_bytes:
                return await _send_413(send, self.max_bytes, self.message)
            return await self.app(scope, receive, send)
        # No declared length (chunked): read up to the limit here, then replay it.
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await _send_413(send, self.max_bytes, self.message)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class RequestGate:
    """Refuses a request before routing when `gate(path, headers)` returns a response (missing
    key, draining), and logs one line per /v1 request when it ends (streams included).

    Every /v1 response carries X-Request-Id: the client's own when it sent a usable one, else a
    fresh id; handlers read it (and may replace it with the body's request_id) from
    `request.state.request_id`, so the header always equals the response id's suffix.

    Pure ASGI on purpose: Starlette's BaseHTTPMiddleware (`@app.middleware("http")`) hands the
    endpoint a receive channel that never reports the client leaving, so a non-streaming
    request whose client gave up would decode on for nobody, and it copies every streamed
    chunk through an extra queue.
    """

    def __init__(self, app: ASGIApp, gate: Callable[[str, Headers], Response | None]) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        refusal = self.gate(path, Headers(scope=scope))
        if refusal is not None:
            return await refusal(scope, receive, send)
        if not path.startswith("/v1/"):
            return await self.app(scope, receive, send)
        t0, status = time.monotonic(), 0
        incoming = Headers(scope=scope).get("x-request-id", "")
        state = scope.setdefault("state", {})
        state["request_id"] = incoming if _REQUEST_ID.fullmatch(incoming) else uuid.uuid4().hex

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", state["request_id"].encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            request_log.info("%s %s %d %.3fs", scope["method"], path, status, time.monotonic() - t0)
