"""Routing strategies: pick one target among healthy candidates. Shared by the gateway (targets
are deployments) and data-parallel serve (targets are engine replicas)."""

from kvserve.routing.cache_aware import CacheAware
from kvserve.routing.policies import LeastLoaded, RoundRobin, SessionAffinity
from kvserve.routing.prefix_index import BlockHashIndex, TextPrefixIndex
from kvserve.routing.registry import SERVE_POLICIES, STRATEGIES, make_strategy
from kvserve.routing.strategies import (
    LatencyBased,
    LeastBusy,
    RequestInfo,
    RoutingStrategy,
    SimpleShuffle,
    Target,
)

__all__ = [
    "SERVE_POLICIES",
    "STRATEGIES",
    "BlockHashIndex",
    "CacheAware",
    "LatencyBased",
    "LeastBusy",
    "LeastLoaded",
    "RequestInfo",
    "RoundRobin",
    "RoutingStrategy",
    "SessionAffinity",
    "SimpleShuffle",
    "Target",
    "TextPrefixIndex",
    "make_strategy",
]
