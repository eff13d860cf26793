"""Cache-aware routing: send a request where its prefix is cached, unless that piles load up.

Score = cached prompt tokens on the target - load_weight x its load (tokens). Weight 1 would
pick the target where the prefill queued ahead plus the request's own uncached part is
smallest, best for this request alone; but a miss elsewhere also costs cache space (the
prefix is then held twice) and later requests' prefill, so the default is 0.5: a holder is
left only when the work queued there is twice the hit. Balance guards as SGLang's: when loads
differ by more than `balance_abs_threshold` tokens AND the highest is over
`balance_rel_threshold` x the lowest, the cache is ignored and the least-loaded target wins,
so one hot prefix cannot overload one replica. A request no target holds `cache_threshold`
of (of what the index can match), or nothing of, is a new prefix: it goes where queued load
plus recently sent work is lowest, ties to the smallest cache (SGLang's smallest tree).
Recent work is the uncached prompt tokens this router sent each target, decayed with time
constant `recent_work_tau` seconds (a rate, not a snapshot), in whole tokens so equal ones
still tie. The same sum over hits alone rebalances them: a holder whose recent hit work is
over `balance_rel_threshold` x the spared target's, and ahead of it by more than the request
would cost there as a miss (and `recent_abs_threshold`), gives the request up, so a tenant
with most of the traffic gets a second holder and its hits split by load. Hits only, because
cold prefills are lumps the new-prefix rule already evens out; counting them too moved hits
of evenly loaded tenants and cost hit rate (measured). Queued load alone is blind to a hot
tenant (its small hits never queue up) and placed cold prefills by whatever was queued the
moment each arrived: 2.39x between the replicas' computed tokens with 80% of requests on one
tenant (docs/BENCHMARKS.md).
The index is exact (engine block hashes) or approximate (prompt text)."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence

from kvserve.routing.policies import least_loaded
from kvserve.routing.prefix_index import BlockHashIndex, TextPrefixIndex
from kvserve.routing.strategies import RequestInfo, RoutingStrategy, Target


class DecayedSum:
    """Per target, a sum of token counts each decayed by exp(-age / tau): a rate of work."""

    def __init__(self, tau: float) -> None:
        self.tau = tau
        self._sums: dict[str, tuple[float, float]] = {}  # target -> (sum, as of)

    def get(self, target_id: str, now: float) -> float:
        total, at = self._sums.get(target_id, (0.0, 0.0))
        return total * math.exp(-max(0.0, now - at) / self.tau) if total else 0.0

    def add(self, target_id: str, tokens: float, now: float) -> None:
        self._sums[target_id] = (self.get(target_id, now) + tokens, now)


class CacheAware(RoutingStrategy):
    def __init__(
        self,
        index: BlockHashIndex | TextPrefixIndex | None = None,
        balance_abs_threshold: float = 2048,
        balance_rel_threshold: float = 1.5,
        load_weight: float = 0.5,
        cache_threshold: float = 0.5,
        recent_work_tau: float = 60.0,
        recent_abs_threshold: float = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.index = index if index is not None else TextPrefixIndex()
        self.abs_threshold, self.rel_threshold = balance_abs_threshold, balance_rel_threshold
        self.load_weight = load_weight
        self.cache_threshold = cache_threshold
        self.clock = clock
        self.recent_abs_threshold = recent_abs_threshold
        self.recent = DecayedSum(recent_work_tau)  # uncached prompt tokens sent
        self.recent_hits = DecayedSum(recent_work_tau)  # the same, of requests that hit

    def recent_work(self, target_id: str) -> float:
        return self.recent.get(target_id, self.clock())

    def _pick(self, candidates: Sequence[Target], key: dict[str, tuple]) -> Target:
        best = min(key.values())
        return random.choice([c for c in candidates if key[c.id] == best])

    def choose(self, candidates: Sequence[Target], request: RequestInfo | None = None) -> Target:
        if request is None:
            return least_loaded(self, candidates)
        now = self.clock()
        loads = {c.id: self.load(c) for c in candidates}
        hi, lo = max(loads.values()), min(loads.values())
        if hi - lo > self.abs_threshold and hi > self.rel_threshold * lo:
            choice = least_loaded(self, candidates)
            hits = self.index.match(request, [choice.id])
            recent = {}
        else:
            hits = self.index.match(request, [c.id for c in candidates])
            recent = {c.id: self.recent.get(c.id, now) for c in candidates}
            spared = {c.id: (round(loads[c.id] + recent[c.id]), self.index.size(c.id)) for c in candidates}
            best_hit = max(hits.values())
            if best_hit == 0 or best_hit < self.cache_threshold * self.index.matchable(request):
                choice = self._pick(candidates, spared)
            else:
                hit_key = {c.id: (0, self.load_weight * loads[c.id] - hits[c.id]) for c in candidates}
                choice = self._pick(candidates, hit_key)
                spare = self._pick(candidates, spared)
                # The holder gives the request up when the hits it was sent lately exceed the
                # spared target's by rel x and by more than the miss costs there (and abs).
                ours, theirs = self.recent_hits.get(choice.id, now), self.recent_hits.get(spare.id, now)
                miss = request.num_tokens - hits[spare.id]
                if (
                    ours - theirs > max(self.recent_abs_threshold, miss)
                    and ours > self.rel_threshold * theirs
                ):
                    choice = spare
        request.cached_tokens = hits[choice.id]
        self.index.routed(choice.id, request)
        uncached = request.num_tokens - request.cached_tokens
        self.recent.add(choice.id, uncached, now)
        if request.cached_tokens:
            self.recent_hits.add(choice.id, uncached, now)
        return choice
