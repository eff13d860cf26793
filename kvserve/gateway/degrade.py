"""Graceful degradation: what a request to a saturated group gets instead of a long queue.

`fallback` sends a fixed share of the alias's requests to a smaller model; the share is
dealt out by an accumulator (every 1/share-th request), not a coin, so "half" is half even
over ten requests. `shed` refuses the least urgent requests (priority >= shed_priority)
with 503 + Retry-After, so urgent ones keep the capacity. Either way the response says so
in `x-kvserve-degraded`.
"""

from __future__ import annotations

from collections.abc import Collection

from kvserve.gateway.config import GatewayConfig
from kvserve.gateway.errors import GatewayError
from kvserve.gateway.metrics import GatewayMetrics
from kvserve.gateway.saturation import SaturationMonitor

HEADER = "x-kvserve-degraded"


class Degrader:
    def __init__(self, cfg: GatewayConfig, monitor: SaturationMonitor, metrics: GatewayMetrics) -> None:
        self.rules = cfg.router_settings.degradation
        self.monitor, self.metrics = monitor, metrics
        self._owed: dict[str, float] = {}  # alias -> fallback share accumulated, not yet sent

    def decide(self, alias: str, body: dict, allowed: Collection[str]) -> str | None:
        """None (serve normally) or the fallback alias to try first; raises the shed 503. A key
        that may not use the fallback (`allowed`: the aliases it may) is served by its own group."""
        rule = self.rules.get(alias)
        if rule is None or (rule.action == "fallback" and rule.fallback not in allowed):
            return None
        sat = self.monitor.group(alias)
        if sat is None or sat < rule.threshold:
            return None
        if rule.action == "shed":
            priority = body.get("priority", 0)
            if isinstance(priority, int) and priority >= rule.shed_priority:
                self.metrics.degraded.labels(alias, "shed").inc()
                raise GatewayError(
                    503,
                    f"{alias}: saturated ({sat:.2f} >= {rule.threshold:g}); requests with priority >= "
                    f"{rule.shed_priority} are shed, retry after {rule.retry_after} s",
                    "server_error",
                    "overloaded",
                    headers={"retry-after": str(rule.retry_after), HEADER: "shed"},
                )
            return None
        owed = self._owed.get(alias, 0.0) + rule.share
        if owed < 1.0 - 1e-9:
            self._owed[alias] = owed
            return None
        self._owed[alias] = owed - 1.0
        self.metrics.degraded.labels(alias, "fallback").inc()
        return rule.fallback
