"""uvicorn's server with SIGTERM / SIGINT handed to a drain, shared by `kvserve serve` and
`kvserve gateway`: the first signal starts the owner's drain (stop admitting, let in-flight
requests finish, then exit); a second one stops at once."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from types import FrameType
from typing import Any, Protocol

import uvicorn


class Drainable(Protocol):
    draining: bool

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None: ...

    def drain(self, server: uvicorn.Server) -> Coroutine[Any, Any, None]: ...


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, lifecycle: Drainable) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.lifecycle.draining:  # a second signal: stop now
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT
            return
        self.lifecycle.draining = True
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(self.lifecycle.spawn, self.lifecycle.drain(self))
