"""Prometheus metrics of the API server, fed once per engine step.

Gauges mirror the scheduler; counters accumulate tokens, requests and preemptions;
latencies are histograms. All names carry the `kvserve:` prefix.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvserve.engine.messages import EngineCoreOutputs
from kvserve.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        r = self.registry = CollectorRegistry()
        lbl = {"labelnames": ["model_name"]}
        self.running = Gauge(
            "kvserve:num_requests_running", "Requests in the running batch", registry=r, **lbl
        )
        self.waiting = Gauge(
            "kvserve:num_requests_waiting", "Requests waiting to be scheduled", registry=r, **lbl
        )
        self.kv_usage = Gauge(
            "kvserve:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", registry=r, **lbl
        )
        self.preemptions = Counter("kvserve:num_preemptions", "Preemptions by recompute", registry=r, **lbl)
        self.prefix_queries = Counter(
            "kvserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r, **lbl
        )
        self.prefix_hits = Counter(
            "kvserve:prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r, **lbl
        )
        self.prompt_tokens = Counter("kvserve:prompt_tokens", "Prompt tokens processed", registry=r, **lbl)
        self.generation_tokens = Counter("kvserve:generation_tokens", "Tokens generated", registry=r, **lbl)
        self.success = Counter(
            "kvserve:request_success",
            "Finished requests",
            labelnames=["model_name", "finished_reason"],
            registry=r,
        )
        h = {"registry": r, "buckets": _LATENCY_BUCKETS, **lbl}
        self.ttft = Histogram("kvserve:time_to_first_token_seconds", "Time to first token", **h)
        self.itl = Histogram("kvserve:inter_token_latency_seconds", "Time between output tokens", **h)
        self.e2e = Histogram("kvserve:e2e_request_latency_seconds", "Arrival to finish", **h)
        self.queue = Histogram("kvserve:request_queue_time_seconds", "Arrival to first scheduled", **h)
        self.iteration_tokens = Histogram(
            "kvserve:iteration_tokens", "Tokens computed per engine step", registry=r,
            buckets=(1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192), **lbl,
        )  # fmt: skip
        spec = "Speculative decoding: "
        self.spec_drafts = Counter(
            "kvserve:spec_decode_num_drafts", spec + "proposals verified", registry=r, **lbl
        )
        self.spec_draft_tokens = Counter(
            "kvserve:spec_decode_num_draft_tokens", spec + "tokens proposed", registry=r, **lbl
        )
        self.spec_accepted = Counter(
            "kvserve:spec_decode_num_accepted_tokens", spec + "proposed tokens accepted", registry=r, **lbl
        )
        self.spec_accepted_pos = Counter(
            "kvserve:spec_decode_num_accepted_tokens_per_pos",
            spec + "accepted tokens by position in the proposal (0 = first)",
            labelnames=["model_name", "position"],
            registry=r,
        )
        self.model = model_name
        self._seen: dict[tuple, int] = {}  # running totals from the core already counted
        self._last_token_time: dict[str, float] = {}

    def _count_total(self, counter: Counter, total: int, *labels: str) -> None:
        """Advance a counter to a running total reported by the engine core."""
        key = (counter, labels)
        seen = self._seen.get(key, 0)
        if total > seen:
            counter.labels(self.model, *labels).inc(total - seen)
            self._seen[key] = total

    def on_step(self, core: EngineCoreOutputs, outs: list[RequestOutput]) -> None:
        m = self.model
        self.running.labels(m).set(core.num_running)
        self.waiting.labels(m).set(core.num_waiting)
        self.kv_usage.labels(m).set(core.kv_cache_usage)
        self._count_total(self.preemptions, core.num_preemptions_total)
        self._count_total(self.prefix_queries, core.prefix_cache_queries)
        self._count_total(self.prefix_hits, core.prefix_cache_hits)
        self._count_total(self.spec_drafts, core.spec_num_drafts)
        self._count_total(self.spec_draft_tokens, core.spec_num_draft_tokens)
        self._count_total(self.spec_accepted, core.spec_num_accepted_tokens)
        for pos, total in enumerate(core.spec_accepted_per_position):
            self._count_total(self.spec_accepted_pos, total, str(pos))
        if core.iteration_tokens:
            self.iteration_tokens.labels(m).observe(core.iteration_tokens)
        now = time.monotonic()
        for out in outs:
            c = out.outputs[0]
            new = len(c.delta_token_ids)
            if new:
                self.generation_tokens.labels(m).inc(new)
            rid, met = out.request_id, out.metrics
            last = self._last_token_time.get(rid)
            if last is None and new:
                if met.time_to_first_token is not None:
                    self.ttft.labels(m).observe(met.time_to_first_token)
                if met.queue_time is not None:
                    self.queue.labels(m).observe(met.queue_time)
                self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
            elif last is not None and new:
                self.itl.labels(m).observe((now - last) / new)
            if out.finished:
                self._last_token_time.pop(rid, None)
                self.success.labels(m, c.finish_reason).inc()
                if met.e2e_latency is not None:
                    self.e2e.labels(m).observe(met.e2e_latency)
            elif new:
                self._last_token_time[rid] = now

    def on_core_lost(self) -> None:
        """The engine core died: its gauges no longer hold, and a new core's running totals
        start from zero again (the counters keep what they counted)."""
        for gauge in (self.running, self.waiting, self.kv_usage):
            gauge.labels(self.model).set(0)
        self._seen.clear()
        self._last_token_time.clear()

    def render(self) -> bytes:
        return generate_latest(self.registry)
