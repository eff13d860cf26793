"""What a front's drain ends at its deadline (the gateway's `general_settings.shutdown_timeout`,
the pd-proxy's `--shutdown-timeout`), as `kvserve serve` ends its own: a stream still running
gets an error event (code `shutting_down`) and its end ([DONE]), a request still waiting for
its answer a 503 + Retry-After. Without it the drain only stopped admitting: uvicorn then
waited for every stream to finish, however long, so a SIGTERM'd pod outlived its timeout until
Kubernetes killed it and cut its streams with no word.

A stream's reads of the upstream run under an `asyncio.timeout` that the deadline fires (a
read that is waiting ends at once, without a task a chunk); a request waiting for its answer
is a task the deadline cancels."""

from __future__ import annotations

import asyncio

RETRY_AFTER = "5"  # seconds, on a 503 while draining: another replica (or this one restarted)


class InFlight:
    def __init__(self, who: str = "the server", flag: str = "shutdown_timeout") -> None:
        self.closing = False
        self.message = f"{who} is shutting down (its {flag} passed)"  # what the ended requests read
        self._reads: set[asyncio.Timeout] = set()
        self._waiting: set[asyncio.Task] = set()

    def waiting(self, task: asyncio.Task) -> None:
        """A request's work until its response starts (cancelled by close())."""
        self._waiting.add(task)
        task.add_done_callback(self._waiting.discard)

    def read(self) -> _Read:
        """`async with in_flight.read(): chunk = await ...`: TimeoutError once close() ran."""
        return _Read(self)

    def close(self) -> None:
        """The deadline: end what is still in flight."""
        self.closing = True
        for t in list(self._reads):
            t.reschedule(asyncio.get_running_loop().time())
        for task in list(self._waiting):
            task.cancel()


class _Read:
    __slots__ = ("owner", "timeout")

    def __init__(self, owner: InFlight) -> None:
        self.owner = owner
        self.timeout = asyncio.timeout(None)

    async def __aenter__(self) -> None:
        if self.owner.closing:
            raise TimeoutError(self.owner.message)
        await self.timeout.__aenter__()
        self.owner._reads.add(self.timeout)

    async def __aexit__(self, et, e, tb) -> bool | None:
        self.owner._reads.discard(self.timeout)
        return await self.timeout.__aexit__(et, e, tb)
