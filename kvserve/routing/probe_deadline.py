"""A health or readiness check's deadline, shared by the gateway and the pd-proxy.

A Kubernetes probe gives up after its timeoutSeconds (1 s unless set) and counts that as a
failure. The fronts' checks waited for every backend's answer (up to 2 s each, in parallel), so
one hung backend out of many failed the probe of every front replica at once, while other
backends could serve. Each check now has PROBE_DEADLINE_S; what has not answered by then
counts as down."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

# under the probe's default timeoutSeconds (1 s), with room for the request itself
PROBE_DEADLINE_S = 0.7
T = TypeVar("T")


async def within(check: Awaitable[T], failed: T) -> T:
    """`check`'s answer, or `failed` when it raises or has not answered by the deadline."""
    try:
        return await asyncio.wait_for(check, PROBE_DEADLINE_S)
    except Exception:  # a timeout, or the check's own error (the store's StoreUnavailable): down
        return failed
