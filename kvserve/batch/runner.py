"""Feed a batch file's lines to the engine, a bounded window at a time.

The input is read one line at a time and at most `window` engine requests are in flight (a
line weighs what it fans out to: prompts x max(n, best_of), up to the whole window), so memory
grows neither with the file nor with what its lines ask for; each finished line goes to the
sink at once, and the sink is committed every `commit_every` seconds. Stopping (cancel,
expiry, shutdown) aborts the lines in flight; they were never recorded, so a resumed run does
them again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from kvserve.batch.execute import TransientError
from kvserve.batch.lines import LineError, error_record, parse_line, response_record, sequences
from kvserve.platform.memory import trim_heap

logger = logging.getLogger("kvserve.batch")
Execute = Callable[[str, dict, str], Awaitable[tuple[int, dict]]]

# Finished lines between heap trims: per-line native allocations (response JSON, ZeroMQ
# frames, msgpack buffers) otherwise stay in RSS after they are freed (docs/BATCH.md).
TRIM_EVERY = 1000


class LineRunner:
    def __init__(self, endpoint: str, execute: Execute, sink, window: int, should_stop: Callable[[], bool],
                 request_prefix: str, commit_every: float = 0.25) -> None:  # fmt: skip
        self.endpoint = endpoint
        self.execute = execute
        self.sink = sink
        self.window = window
        self.should_stop = should_stop
        self.request_prefix = request_prefix
        self.commit_every = commit_every
        self._in_flight = 0  # engine requests of the lines running (each line's weight)
        self._tasks: set[asyncio.Task] = set()
        self._last_commit = time.monotonic()
        self._since_trim = 0  # lines finished since the heap was last trimmed

    async def run(self, path: str, start_line: int = 0, start_offset: int = 0) -> bool:
        """Run every line not yet done; True when the file was finished, False when stopped."""
        try:
            finished = await self._feed(path, start_line, start_offset) and await self._drain()
        finally:  # stopped, cancelled from outside, or an error: abort whatever is in flight
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self.sink.commit()
        return finished

    async def _feed(self, path: str, line: int, offset: int) -> bool:
        with open(path, "rb") as f:
            f.seek(offset)
            while raw := f.readline():
                end = f.tell()
                if self.sink.is_done(line) or not raw.strip():
                    self.sink.add(line, end, None, True)
                else:
                    try:
                        parsed: tuple[str, dict] | LineError = parse_line(raw, self.endpoint)
                        weight = min(sequences(parsed[1], self.endpoint), self.window)
                    except LineError as e:
                        parsed, weight = e, 1
                    while self._in_flight + weight > self.window and not self.should_stop():
                        await self._wait_some()  # window full: wait for a line
                    if self.should_stop():
                        return False
                    self._in_flight += weight
                    task = asyncio.create_task(self._one(line, end, parsed, weight))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                    self._maybe_commit()
                line += 1
        return True

    async def _drain(self) -> bool:
        while self._tasks:
            if self.should_stop():
                return False
            await self._wait_some()
        return True

    async def _wait_some(self) -> None:
        await asyncio.wait(set(self._tasks), timeout=self.commit_every, return_when=asyncio.FIRST_COMPLETED)
        self._maybe_commit()

    def _maybe_commit(self) -> None:
        if time.monotonic() - self._last_commit >= self.commit_every:
            self.sink.commit()
            self._last_commit = time.monotonic()
            if self._since_trim >= TRIM_EVERY:  # memory stays flat over any number of lines
                self._since_trim = 0
                trim_heap()

    async def _one(self, line: int, end: int, parsed: tuple[str, dict] | LineError, weight: int) -> None:
        try:
            if isinstance(parsed, LineError):
                self.sink.add(line, end, error_record(parsed), False)
                return
            custom_id, body = parsed
            request_id = f"{self.request_prefix}-{line}"
            try:
                result = await self._execute(line, body, request_id)
            except Exception as e:  # our bug, not the client's: the line still gets its error line
                logger.exception("batch line %d (%s) failed", line, request_id)
                message = f"internal error: {type(e).__name__}: {e}"
                result = 500, {"error": {"message": message, "type": "internal_error", "param": None,
                                         "code": "internal_error"}}  # fmt: skip
            if result is None:  # stopped while waiting to retry: the line is done again on resume
                return
            status, resp = result
            self.sink.add(line, end, response_record(custom_id, status, request_id, resp), status == 200)
        finally:
            self._since_trim += 1
            self._in_flight -= weight

    async def _execute(self, line: int, body: dict, request_id: str) -> tuple[int, dict] | None:
        """(status, body) of the line, retried while the engine cannot take it; None once stopped."""
        delay = 0.5
        while True:
            try:
                return await self.execute(self.endpoint, body, request_id)
            except TransientError as e:
                if self.should_stop():
                    return None
                logger.info("batch line %d: %s; retrying in %.1fs", line, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
