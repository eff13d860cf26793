"""Cache-aware routing: send a request where its prefix is cached, unless that piles load up.

Score = cached prompt tokens on the target - load_weight x its load (tokens). Weight 1 would
pick the target where the prefill queued ahead plus the request's own uncached part is
smallest, best for this request alone; but a miss elsewhere also costs cache space (the
prefix is then held twice) and later requests' prefill, so the default is 0.5: a holder is
left only when the work queued there is twice the hit. Balance guards as SGLang's: when loads
differ by more than `balance_abs_threshold` tokens AND the highest is over
`balance_rel_threshold` x the lowest, the cache is ignored and the least-loaded target wins,
so one hot prefix cannot overload one replica. A request no target holds `cache_threshold`
of (of what the index can match), or nothing of, is a new prefix: it goes to the
least-loaded target, ties to the smallest cache (SGLang's smallest tree), so new prefixes
spread over idle replicas instead of landing at random, and a burst of them still follows the
load. The index is exact (engine block hashes) or approximate (prompt text)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvserve.routing.policies import least_loaded
from kvserve.routing.prefix_index import BlockHashIndex, TextPrefixIndex
from kvserve.routing.strategies import RequestInfo, RoutingStrategy, Target


class CacheAware(RoutingStrategy):
    def __init__(
        self,
        index: BlockHashIndex | TextPrefixIndex | None = None,
        balance_abs_threshold: float = 2048,
        balance_rel_threshold: float = 1.5,
        load_weight: float = 0.5,
        cache_threshold: float = 0.5,
    ) -> None:
        super().__init__()
        self.index = index if index is not None else TextPrefixIndex()
        self.abs_threshold, self.rel_threshold = balance_abs_threshold, balance_rel_threshold
        self.load_weight = load_weight
        self.cache_threshold = cache_threshold

    def choose(self, candidates: Sequence[Target], request: RequestInfo | None = None) -> Target:
        if request is None:
            return least_loaded(self, candidates)
        loads = {c.id: self.load(c) for c in candidates}
        hi, lo = max(loads.values()), min(loads.values())
        if hi - lo > self.abs_threshold and hi > self.rel_threshold * lo:
            choice = least_loaded(self, candidates)
            hits = self.index.match(request, [choice.id])
        else:
            hits = self.index.match(request, [c.id for c in candidates])
            best_hit = max(hits.values())
            if best_hit == 0 or best_hit < self.cache_threshold * self.index.matchable(request):
                key = {c.id: (loads[c.id], self.index.size(c.id)) for c in candidates}
            else:
                key = {c.id: (0, self.load_weight * loads[c.id] - hits[c.id]) for c in candidates}
            best = min(key.values())
            choice = random.choice([c for c in candidates if key[c.id] == best])
        request.cached_tokens = hits[choice.id]
        self.index.routed(choice.id, request)
        return choice
