"""Slow-reader detection for streams: a client that stops reading fills its socket's buffers,
and then every send of ours waits. A stream whose send has waited longer than the stall
timeout is aborted in the engine (its KV blocks freed) instead of decoding on until the
request timeout for nobody."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

logger = logging.getLogger("kvserve.server")


class StallWatch:
    def __init__(self, timeout: float | None, on_stall: Callable[[], Awaitable[None]]) -> None:
        self.timeout = timeout
        self.on_stall = on_stall
        self._since: float | None = None  # when the send now waiting began
        self._task = asyncio.create_task(self._watch()) if timeout else None

    def sending(self) -> None:
        self._since = time.monotonic()

    def sent(self) -> None:
        self._since = None

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _watch(self) -> None:
        period = min(1.0, self.timeout / 4)
        while True:
            await asyncio.sleep(period)
            if self._since is not None and time.monotonic() - self._since > self.timeout:
                logger.warning("stream stalled: client read nothing for %.0fs; aborting it", self.timeout)
                await self.on_stall()
                return
