"""Routing strategies: pick one target among healthy candidates. Shared by the gateway (targets
are deployments) and, later, data-parallel serve (targets are engine replicas)."""

from kvserve.routing.strategies import (
    STRATEGIES,
    LatencyBased,
    LeastBusy,
    RoutingStrategy,
    SimpleShuffle,
    Target,
    make_strategy,
)

__all__ = [
    "STRATEGIES",
    "LatencyBased",
    "LeastBusy",
    "RoutingStrategy",
    "SimpleShuffle",
    "Target",
    "make_strategy",
]
