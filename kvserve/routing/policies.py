"""Request-aware policies beside the gateway's originals: round-robin, least-loaded (in
tokens, not requests) and session affinity."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

from kvserve.routing.strategies import RequestInfo, RoutingStrategy, Target


def least_loaded(strategy: RoutingStrategy, candidates: Sequence[Target]) -> Target:
    """The lowest load; ties at random so equal replicas share the work."""
    loads = [strategy.load(c) for c in candidates]
    low = min(loads)
    return random.choice([c for c, load in zip(candidates, loads) if load == low])


class RoundRobin(RoutingStrategy):
    """Each candidate in turn (by id, so a changing candidate set keeps a stable order)."""

    def __init__(self) -> None:
        super().__init__()
        self.turn = 0

    def choose(self, candidates: Sequence[Target], request: RequestInfo | None = None) -> Target:
        ordered = sorted(candidates, key=lambda c: c.id)
        self.turn += 1
        return ordered[(self.turn - 1) % len(ordered)]


class LeastLoaded(RoutingStrategy):
    """Lowest load in tokens: prompt tokens still to prefill + one per running sequence. A
    1,000-token prompt weighs what it costs, where a request count would call it one."""

    def choose(self, candidates: Sequence[Target], request: RequestInfo | None = None) -> Target:
        return least_loaded(self, candidates)


class SessionAffinity(RoutingStrategy):
    """One session (the `x-session-id` header or the `user` field) to one target, by rendezvous
    hashing: when a target leaves, only its sessions move. No session: least-loaded."""

    def choose(self, candidates: Sequence[Target], request: RequestInfo | None = None) -> Target:
        if request is None or not request.session:
            return least_loaded(self, candidates)
        key = request.session.encode()

        def rank(c: Target) -> bytes:
            return hashlib.blake2b(key + b"\0" + c.id.encode(), digest_size=8).digest()

        return max(candidates, key=rank)
