"""The strategy interface is three calls: choose() among candidates, started() when a request
goes to the choice, finished() with its latency (released() when the attempt ended saying
nothing of the target: the request's own 4xx, the client leaving). A new policy implements
the three and nothing else changes. The gateway (targets: deployments) and data-parallel
serve (targets: engine replicas) share it; policies that look at the request get a `RequestInfo`."""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Target(Protocol):
    """`load` (tokens) is optional: engine replicas know theirs exactly; without it a strategy
    counts what it sent (in-flight prompt tokens + one per in-flight request)."""

    id: str
    weight: float


@dataclass
class RequestInfo:
    """What a policy may look at: prompt token ids (serve), or prompt text (gateway, which does
    not tokenize), the session key (header or `user`), the cache scope (`cache_salt`)."""

    token_ids: Sequence[int] | None = None
    text: str | None = None
    session: str | None = None
    cache_salt: str | None = None
    cached_tokens: int = 0  # set by cache-aware routing: the hit it expects on its choice
    text_keys: list[int] | None = None  # TextPrefixIndex's chunk keys, computed once
    block_hashes: list[bytes] | None = None  # BlockHashIndex's chained block hashes, computed once

    @property
    def num_tokens(self) -> int:
        if self.token_ids is not None:
            return len(self.token_ids)
        return len(self.text or "") // 4  # ~4 characters per token: only for load estimates


class RoutingStrategy:
    def __init__(self) -> None:
        self.in_flight: dict[str, int] = defaultdict(int)
        self.in_flight_tokens: dict[str, int] = defaultdict(int)

    def choose(self, candidates: Sequence[Target], request: RequestInfo | None = None) -> Target:
        raise NotImplementedError

    def started(self, target_id: str, request: RequestInfo | None = None) -> None:
        self.in_flight[target_id] += 1
        if request is not None:
            self.in_flight_tokens[target_id] += request.num_tokens - request.cached_tokens

    def finished(self, target_id: str, latency: float | None, request: RequestInfo | None = None) -> None:
        """latency: seconds to the first byte, None when the attempt failed (the target's fault)."""
        RoutingStrategy.released(self, target_id, request)

    def released(self, target_id: str, request: RequestInfo | None = None) -> None:
        """The attempt ended saying nothing of the target's speed or health (the request's own
        4xx, the client leaving): it is no longer in flight, and no policy learns from it."""
        self.in_flight[target_id] -= 1
        if request is not None:
            self.in_flight_tokens[target_id] -= request.num_tokens - request.cached_tokens

    def load(self, target: Target) -> float:
        """Load in tokens: the target's own figure, else what this strategy has in flight there."""
        own = getattr(target, "load", None)
        if own is not None:
            return own
        return self.in_flight_tokens[target.id] + self.in_flight[target.id]


class SimpleShuffle(RoutingStrategy):
    """Weighted random: traffic in proportion to each target's weight."""

    def choose(self, candidates: Sequence[Target], request: RequestInfo | None = None) -> Target:
        if len(candidates) == 1:
            return candidates[0]
        return random.choices(candidates, weights=[c.weight for c in candidates])[0]


class LeastBusy(RoutingStrategy):
    """Fewest requests in flight from this instance; ties broken at random."""

    def choose(self, candidates: Sequence[Target], request: RequestInfo | None = None) -> Target:
        low = min(self.in_flight[c.id] for c in candidates)
        return random.choice([c for c in candidates if self.in_flight[c.id] == low])


class LatencyBased(RoutingStrategy):
    """Lowest moving average of time to first byte; untried targets first, failures count as
    slow so a sick target is probed rather than hammered: one not chosen in `probe_every`
    choices gets the next request, so its average follows what it does now. (Without the probe
    one failure put a target's average above the others' for good, since only a request sent
    there could lower it again: a recovered, faster deployment got no traffic at all.)"""

    def __init__(self, alpha: float = 0.2, failure_penalty: float = 10.0, probe_every: int = 50) -> None:
        super().__init__()
        self.alpha, self.penalty, self.probe_every = alpha, failure_penalty, probe_every
        self.ewma: dict[str, float] = {}
        self.choices = 0  # choose() calls so far
        self.last_chosen: dict[str, int] = {}  # target id -> the choice that last picked it

    def choose(self, candidates: Sequence[Target], request: RequestInfo | None = None) -> Target:
        self.choices += 1
        untried = [c for c in candidates if c.id not in self.ewma]
        if untried:
            pick = random.choice(untried)
        else:
            stale = [c for c in candidates if self.choices - self.last_chosen.get(c.id, 0) > self.probe_every]
            pick = min(stale or candidates, key=lambda c: self.ewma[c.id])
        self.last_chosen[pick.id] = self.choices
        return pick

    def finished(self, target_id: str, latency: float | None, request: RequestInfo | None = None) -> None:
        super().finished(target_id, latency, request)
        sample = self.penalty if latency is None else latency
        old = self.ewma.get(target_id, sample)
        self.ewma[target_id] = (1 - self.alpha) * old + self.alpha * sample
