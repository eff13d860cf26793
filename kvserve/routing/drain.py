"""Graceful shutdown of a front (`kvserve gateway`, `kvserve pd-proxy`), the same contract as
`kvserve serve` (kvserve/entrypoints/openai/lifecycle.py) so one set of probes and preStop
hooks fits them all.

SIGTERM / SIGINT start a drain (entrypoints/draining_server.py): readiness turns false at once
(a load balancer stops sending), new requests get 503 + Retry-After while the listener stays
open, requests in flight (streams included) finish until the shutdown timeout; those still
running then are ended as kvserve serve ends them (in_flight.py: a stream's error event and
[DONE], a waiting request's 503), and uvicorn closes. A second signal exits at once. A front
keeps no state of its own to hand over (the gateway's lives in its store).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import uvicorn

ENDING_S = 5.0  # after the deadline: for the ended requests' last bytes (a client that does not
# read holds its stream: uvicorn's timeout_graceful_shutdown, as long, then cancels it)


class DrainLifecycle:
    def __init__(
        self,
        shutdown_timeout: float,
        in_flight: Callable[[], int],
        end_in_flight: Callable[[], None],
        log: logging.Logger,
    ) -> None:
        self.shutdown_timeout = shutdown_timeout
        self.in_flight = in_flight
        self.end_in_flight = end_in_flight  # at the deadline: what is still running ends now
        self.log = log
        self.draining = False
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, server: uvicorn.Server) -> None:
        self.draining = True
        deadline = time.monotonic() + self.shutdown_timeout
        self.log.info(
            "shutting down: draining %d request(s) for up to %.0fs", self.in_flight(), self.shutdown_timeout
        )
        while self.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight():
            self.log.warning("shutdown deadline: ending %d request(s) still in flight", self.in_flight())
            self.end_in_flight()
            end = time.monotonic() + ENDING_S  # their last events sent, their spend settled
            while self.in_flight() and time.monotonic() < end:
                await asyncio.sleep(0.05)
        server.should_exit = True
