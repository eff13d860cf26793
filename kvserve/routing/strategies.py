"""The strategy interface is three calls: choose() among candidates, started() when a request
goes to the choice, finished() with its latency. A new policy (cache-aware, session) implements
those and nothing else changes."""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence
from typing import Protocol


class Target(Protocol):
    id: str
    weight: float


class RoutingStrategy:
    def __init__(self) -> None:
        self.in_flight: dict[str, int] = defaultdict(int)

    def choose(self, candidates: Sequence[Target]) -> Target:
        raise NotImplementedError

    def started(self, target_id: str) -> None:
        self.in_flight[target_id] += 1

    def finished(self, target_id: str, latency: float | None) -> None:
        """latency: seconds to the first byte, None when the attempt failed."""
        self.in_flight[target_id] -= 1


class SimpleShuffle(RoutingStrategy):
    """Weighted random: traffic in proportion to each target's weight."""

    def choose(self, candidates: Sequence[Target]) -> Target:
        if len(candidates) == 1:
            return candidates[0]
        return random.choices(candidates, weights=[c.weight for c in candidates])[0]


class LeastBusy(RoutingStrategy):
    """Fewest requests in flight from this instance; ties broken at random."""

    def choose(self, candidates: Sequence[Target]) -> Target:
        low = min(self.in_flight[c.id] for c in candidates)
        return random.choice([c for c in candidates if self.in_flight[c.id] == low])


class LatencyBased(RoutingStrategy):
    """Lowest moving average of time to first byte; untried targets first, failures count as
    slow so a sick target is probed rather than hammered."""

    def __init__(self, alpha: float = 0.2, failure_penalty: float = 10.0) -> None:
        super().__init__()
        self.alpha, self.penalty = alpha, failure_penalty
        self.ewma: dict[str, float] = {}

    def choose(self, candidates: Sequence[Target]) -> Target:
        untried = [c for c in candidates if c.id not in self.ewma]
        if untried:
            return random.choice(untried)
        return min(candidates, key=lambda c: self.ewma[c.id])

    def finished(self, target_id: str, latency: float | None) -> None:
        super().finished(target_id, latency)
        sample = self.penalty if latency is None else latency
        old = self.ewma.get(target_id, sample)
        self.ewma[target_id] = (1 - self.alpha) * old + self.alpha * sample


STRATEGIES = {"simple-shuffle": SimpleShuffle, "least-busy": LeastBusy, "latency-based": LatencyBased}


def make_strategy(name: str) -> RoutingStrategy:
    return STRATEGIES[name]()
