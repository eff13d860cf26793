"""A streamed answer whose settlement always runs (the gateway's spend and limits, the pd-proxy's
count of requests in flight that its drain waits for).

Starlette iterates the body only once the response has started: a client gone before that
(the server's send raising at the response's start, as uvicorn's does for a closed connection)
left the body generator never started, so nothing in it, the settlement included, ever ran;
one gone mid-stream left it suspended until garbage collection. Here the generator is closed
when the response ends however it ends, and `on_close` runs after it (a no-op when the body
has settled already)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class SettledStream(StreamingResponse):
    def __init__(
        self, body: AsyncGenerator[bytes, None], on_close: Callable[[], Awaitable[None]], **kwargs
    ) -> None:
        super().__init__(body, **kwargs)
        self._body, self.on_close = body, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()
            await self.on_close()
