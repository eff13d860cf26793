"""Prometheus metrics for one gateway process (its own registry, so tests and embedders can
build several apps in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "kvserve_gateway_"
        self.requests = Counter(p + "requests", "Client requests answered", ["model", "status"], registry=r)
        self.attempts = Counter(
            p + "attempts", "Upstream attempts by outcome", ["deployment", "outcome"], registry=r
        )
        self.rate_limited = Counter(p + "rate_limited", "Requests refused by a limit", ["limit"], registry=r)
        self.cooldowns = Counter(p + "cooldowns", "Deployments put into cooldown", ["deployment"], registry=r)
        self.in_flight = Gauge(p + "in_flight", "Client requests in flight", registry=r)
        self.latency = Histogram(
            p + "request_seconds",
            "Time to the response head (streams: first event)",
            ["model"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.group_saturation = Gauge(
            p + "group_saturation",
            "Mean kvserve:saturation of a group's backends (polled)",
            ["model"],
            registry=r,
        )
        self.degraded = Counter(
            p + "degraded", "Requests degraded under saturation", ["model", "action"], registry=r
        )
        self.cache = Counter(p + "cache", "Response cache lookups by result", ["model", "result"], registry=r)
        self.spend = Counter(p + "spend", "Money spent (settled)", ["model"], registry=r)
