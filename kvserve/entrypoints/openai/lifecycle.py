"""Readiness and graceful shutdown of `kvserve serve`.

- Liveness (`/health`) is "the engine core is running"; readiness (`/health/ready`) also
  needs one warm-up request served (kernels built, first step paid) and no drain under way.
- SIGTERM / SIGINT start a drain instead of uvicorn's immediate close: readiness turns false,
  new requests get 503 + Retry-After while the listener stays open, in-flight requests may
  finish until `shutdown_timeout`, and at the deadline the ones still running are failed
  (streams get an error event and `[DONE]`). Then uvicorn closes and the engine stops (its
  IPC files removed). A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import time

import uvicorn

from kvserve.engine.async_llm import AsyncLLM
from kvserve.entrypoints.openai.gc_freeze import freeze_startup_heap
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger("kvserve.server")

FLUSH_S = 1.0  # time the last streams get to send their error event before the server closes


class ServerShuttingDownError(RuntimeError):
    """The server is draining: not accepting requests, or the drain deadline came (503)."""


class Lifecycle:
    def __init__(self, engine: AsyncLLM, shutdown_timeout: float) -> None:
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.warmed_up = False
        self.draining = False
        self._tasks: set[asyncio.Task] = set()

    @property
    def ready(self) -> bool:
        return self.warmed_up and self.engine.is_alive and not self.draining

    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def warm_up(self) -> None:
        """One tiny greedy request through the whole path before readiness turns true."""
        tok = self.engine.tokenizer
        first = tok.bos_token_id if tok.bos_token_id is not None else 0
        params = SamplingParams(temperature=0, max_tokens=1)
        replicas = getattr(self.engine, "engines", [self.engine])  # each data-parallel replica
        try:
            for i, engine in enumerate(replicas):
                stream = engine.add_request([first], params, "warmup" if i == 0 else f"warmup-{i}")
                async for _ in stream:
                    pass
        except Exception as e:  # noqa: BLE001 - readiness stays false; liveness tells the rest
            logger.error("warm-up request failed: %s", e)
            return
        frozen = freeze_startup_heap()  # after the warm-up: its kernels' objects stay too
        self.warmed_up = True
        logger.info("warm-up request served; ready (%d start-up objects frozen out of the GC)", frozen)

    async def drain(self, server: uvicorn.Server) -> None:
        self.draining = True
        engine = self.engine
        deadline = time.monotonic() + max(0.0, self.shutdown_timeout - FLUSH_S)
        logger.info(
            "shutting down: draining %d in-flight request(s) for up to %.0fs",
            engine.num_in_flight, self.shutdown_timeout,
        )  # fmt: skip
        while engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if engine.num_in_flight:
            logger.warning("shutdown deadline: failing %d request(s) still running", engine.num_in_flight)
            engine.fail_all(ServerShuttingDownError("the server is shutting down"))
            await asyncio.sleep(min(FLUSH_S, 0.3))
        server.should_exit = True
