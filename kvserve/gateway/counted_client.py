"""An httpx client that knows how many of its requests are in flight (sent, and their answer
not yet closed: waiting for a connection included), so a deployment's pool can hand a request
to its least-busy client: taken in turn, long streams piled onto one client and a request
waited behind them while another client's connections sat idle."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx


class _Counted(httpx.AsyncByteStream):
    """An answer's body that tells its client when it is closed (read to its end, or left)."""

    def __init__(self, inner: httpx.AsyncByteStream, done: Callable[[], None]) -> None:
        self._inner, self._done = inner, done

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            yield chunk

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            self._done()


class CountedClient(httpx.AsyncClient):
    """httpx.AsyncClient counting its in-flight requests (`in_flight`). Counted in send, not in
    a transport, so the proxies httpx reads from the environment still apply."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.in_flight = 0

    async def send(self, request: httpx.Request, *, stream: bool = False, **kw: Any) -> httpx.Response:
        self.in_flight += 1
        closed = False

        def done() -> None:
            nonlocal closed
            if not closed:
                closed = True
                self.in_flight -= 1

        try:
            resp = await super().send(request, stream=stream, **kw)
        except BaseException:
            done()
            raise
        if resp.is_closed:  # not streamed: read whole and closed already
            done()
        else:
            resp.stream = _Counted(resp.stream, done)  # type: ignore[arg-type]
        return resp
