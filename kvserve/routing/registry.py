"""Policy names, as the gateway config and `kvserve serve --routing-policy` spell them."""

from __future__ import annotations

from kvserve.routing.cache_aware import CacheAware
from kvserve.routing.policies import LeastLoaded, RoundRobin, SessionAffinity
from kvserve.routing.prefix_index import BlockHashIndex
from kvserve.routing.strategies import LatencyBased, LeastBusy, RoutingStrategy, SimpleShuffle

STRATEGIES = {
    "simple-shuffle": SimpleShuffle,
    "least-busy": LeastBusy,
    "latency-based": LatencyBased,
    "round-robin": RoundRobin,
    "least-loaded": LeastLoaded,
    "session": SessionAffinity,
    "cache-aware": CacheAware,
}
SERVE_POLICIES = ("round-robin", "least-loaded", "session", "cache-aware")


def make_strategy(name: str, block_size: int | None = None, **cache_aware: float) -> RoutingStrategy:
    """A fresh strategy. `block_size` makes cache-aware exact (engine block hashes, for serve's
    replicas); without it cache-aware matches prompt text (the gateway). `cache_aware` holds
    CacheAware's thresholds."""
    if name not in STRATEGIES:
        raise ValueError(f"routing_policy: {name!r} is not one of {', '.join(STRATEGIES)}")
    if name == "cache-aware":
        index = BlockHashIndex(block_size) if block_size is not None else None
        return CacheAware(index, **cache_aware)
    return STRATEGIES[name]()
