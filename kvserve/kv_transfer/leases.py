"""The producer's held blocks: one lease per request finished for a remote decode.

The transfer thread takes a lease when a consumer pulls (or releases it), copies the blocks
and hands them back to be freed; the engine thread frees them (the block pool is its own)
and also frees every lease nobody took within `lease_s`, so a consumer that never comes
cannot strand blocks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Lease:
    blocks: list[int]
    num_tokens: int
    digest: str
    expires: float


class LeaseTable:
    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_s
        self.clock = clock
        self._held: dict[str, Lease] = {}
        self._released: list[list[int]] = []
        self._lock = threading.Lock()
        self.num_expired = 0

    def add(self, handle: str, blocks: list[int], num_tokens: int, digest: str) -> None:
        with self._lock:
            self._held[handle] = Lease(blocks, num_tokens, digest, self.clock() + self.lease_s)

    def take(self, handle: str) -> Lease | None:
        """The lease for a transfer (gone from the table; `release` its blocks when copied)."""
        with self._lock:
            return self._held.pop(handle, None)

    def release(self, blocks: list[int]) -> None:
        with self._lock:
            self._released.append(blocks)

    def drain(self) -> list[list[int]]:
        """Block lists to free now: released ones and those of expired leases (engine thread)."""
        now = self.clock()
        with self._lock:
            for handle in [h for h, lease in self._held.items() if lease.expires <= now]:
                self._released.append(self._held.pop(handle).blocks)
                self.num_expired += 1
            out, self._released = self._released, []
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._held) + len(self._released)
