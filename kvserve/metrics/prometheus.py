"""Prometheus metrics of the API server, fed once per engine step.

Gauges mirror the scheduler; counters accumulate tokens, requests and preemptions;
latencies are histograms. All names carry the `kvserve:` prefix. With data-parallel
replicas every series also carries `engine`: "0", "1", ... per replica and "total" for the
whole server (so sum over `engine!="total"`, or read `engine="total"`).

The scaling signals (docs/DEPLOYMENT.md): `num_requests_waiting`, `kv_cache_usage_perc`,
`num_waiting_prefill_tokens` (read from the engine's streams when /metrics is scraped) and
`saturation` (kvserve/metrics/saturation.py), the one meant as an autoscaler's target.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvserve.engine.messages import EngineCoreOutputs
from kvserve.metrics.saturation import saturation
from kvserve.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
# Tokens per request: 1, 2, 5, 10, ... 1,000,000 (vLLM's 1-2-5 series)
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5) if m * 10**e <= 10**6)


class ServerMetrics:
    def __init__(self, model_name: str, num_engines: int = 1, max_num_seqs: int = 128) -> None:
        r = self.registry = CollectorRegistry()
        base = ["model_name"] + (["engine"] if num_engines > 1 else [])
        lbl = {"labelnames": base}
        self.running = Gauge(
            "kvserve:num_requests_running", "Requests in the running batch", registry=r, **lbl
        )
        self.waiting = Gauge(
            "kvserve:num_requests_waiting", "Requests waiting to be scheduled", registry=r, **lbl
        )
        self.kv_usage = Gauge(
            "kvserve:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", registry=r, **lbl
        )
        self.saturation = Gauge(
            "kvserve:saturation",
            "Share of the replica's capacity in use: max(KV usage, running / max_num_seqs) "
            "+ waiting / max_num_seqs; above 1 requests queue (the autoscaling target)",
            registry=r, **lbl,
        )  # fmt: skip
        self.batch_running = Gauge(
            "kvserve:num_batch_requests_running", "Batch API lines in the running batch (not in "
            "num_requests_running nor saturation: they yield to interactive requests)", registry=r, **lbl,
        )  # fmt: skip
        self.batch_waiting = Gauge(
            "kvserve:num_batch_requests_waiting", "Batch API lines waiting (not in num_requests_waiting)",
            registry=r, **lbl,
        )  # fmt: skip
        self.waiting_prefill = Gauge(
            "kvserve:num_waiting_prefill_tokens",
            "Prompt tokens still to compute for requests with no output yet (queued or prefilling)",
            registry=r, **lbl,
        )  # fmt: skip
        self.preemptions = Counter("kvserve:num_preemptions", "Preemptions by recompute", registry=r, **lbl)
        self.prefix_queries = Counter(
            "kvserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r, **lbl
        )
        self.prefix_hits = Counter(
            "kvserve:prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r, **lbl
        )
        # Prefill/decode disaggregation (kv_transfer/): a consumer's fetches, a producer's leases
        self.kv_transfers = Counter(
            "kvserve:kv_transfers", "Prompt KV fetches from a prefill engine that landed", registry=r, **lbl
        )
        self.kv_transfer_failures = Counter(
            "kvserve:kv_transfer_failures",
            "Prompt KV fetches that failed or timed out (the prompt was computed here instead)",
            registry=r, **lbl,
        )  # fmt: skip
        self.kv_transfer_bytes = Counter(
            "kvserve:kv_transfer_bytes", "Bytes of KV blocks fetched", registry=r, **lbl
        )
        self.kv_transfer_seconds = Counter(
            "kvserve:kv_transfer_seconds",
            "Seconds spent in KV fetches (request to last byte)",
            registry=r,
            **lbl,
        )
        self.kv_leases_expired = Counter(
            "kvserve:kv_leases_expired", "Producer leases freed because no consumer came", registry=r, **lbl
        )
        self.prompt_tokens = Counter("kvserve:prompt_tokens", "Prompt tokens processed", registry=r, **lbl)
        self.generation_tokens = Counter("kvserve:generation_tokens", "Tokens generated", registry=r, **lbl)
        self.success = Counter(
            "kvserve:request_success",
            "Finished requests",
            labelnames=[*base, "finished_reason"],
            registry=r,
        )
        h = {"registry": r, "buckets": _LATENCY_BUCKETS, **lbl}
        self.ttft = Histogram("kvserve:time_to_first_token_seconds", "Time to first token", **h)
        self.itl = Histogram("kvserve:inter_token_latency_seconds", "Time between output tokens", **h)
        self.e2e = Histogram("kvserve:e2e_request_latency_seconds", "Arrival to finish", **h)
        self.queue = Histogram("kvserve:request_queue_time_seconds", "Arrival to first scheduled", **h)
        # Per finished request, as vLLM's dashboard reads them (prefill, decode, lengths)
        self.prefill_time = Histogram(
            "kvserve:request_prefill_time_seconds", "First scheduled to first token", **h
        )
        self.decode_time = Histogram("kvserve:request_decode_time_seconds", "First token to finish", **h)
        self.inference_time = Histogram(
            "kvserve:request_inference_time_seconds", "First scheduled to finish", **h
        )
        self.request_tpot = Histogram(
            "kvserve:request_time_per_output_token_seconds",
            "A finished request's decode time over its output tokens after the first",
            **h,
        )
        t = {"registry": r, "buckets": _TOKEN_BUCKETS, **lbl}
        self.request_prompt = Histogram("kvserve:request_prompt_tokens", "Prompt tokens of a request", **t)
        self.request_generation = Histogram(
            "kvserve:request_generation_tokens", "Tokens a request generated", **t
        )
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
            labelnames=[*base, "position"],
            registry=r,
        )
        self.model = model_name
        self.num_engines = num_engines
        self.max_num_seqs = max_num_seqs
        # per engine: prompt tokens of requests not started yet; set by the server, read at scrape
        self.pending_prefill: Callable[[], list[int]] | None = None
        self._seen: dict[tuple, int] = {}  # running totals from each core already counted
        self._last_token_time: dict[str, float] = {}
        self._engine_of: dict[str, int] = {}  # request -> replica, for requests with a token
        self._children: dict[tuple, list] = {}  # (metric, engine, extra labels) -> its series
        self._gauges: dict[int, tuple] = {}  # engine -> running, waiting, kv usage, then the batch lines'

    def _labels(self, engine: int) -> list[tuple[str, ...]]:
        """The label sets one engine's numbers go to: its own, and the total with replicas."""
        if self.num_engines == 1:
            return [(self.model,)]
        return [(self.model, str(engine)), (self.model, "total")]

    def _series(self, metric, engine: int, *extra: str) -> list:
        """The labelled children one engine's number goes to, looked up once (prometheus_client
        validates and locks on every `labels()`; this runs per engine step)."""
        key = (metric, engine, extra)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = [metric.labels(*lb, *extra) for lb in self._labels(engine)]
        return children

    def _inc(self, metric, amount: float, engine: int, *extra: str) -> None:
        for child in self._series(metric, engine, *extra):
            child.inc(amount)

    def _observe(self, metric, value: float, engine: int) -> None:
        for child in self._series(metric, engine):
            child.observe(value)

    def _count_total(self, counter: Counter, total: int, engine: int, *labels: str) -> None:
        """Advance a counter to a running total reported by an engine core."""
        key = (counter, engine, labels)
        seen = self._seen.get(key, 0)
        if total > seen:
            self._inc(counter, total - seen, engine, *labels)
            self._seen[key] = total

    def _set_gauges(self, engine: int, core: EngineCoreOutputs | None = None) -> None:
        """The interactive load (running, waiting, saturation) net of the batch lines', which
        yield to it (preempted first, no tokens while others run): a batch alone must not look
        like a full replica to an autoscaler or the gateway. KV usage stays the pool's own."""
        vals = (0, 0, 0.0, 0, 0, 0.0) if core is None else (
            core.num_running, core.num_waiting, core.kv_cache_usage,
            core.num_running_background, core.num_waiting_background, core.kv_cache_usage_background,
        )  # fmt: skip
        if self._gauges.get(engine) == vals:
            return  # most steps change none of them
        self._gauges[engine] = vals
        for labels, (running, waiting, kv, bg_running, bg_waiting, _) in self._gauge_sets(engine):
            self.running.labels(*labels).set(running - bg_running)
            self.waiting.labels(*labels).set(waiting - bg_waiting)
            self.batch_running.labels(*labels).set(bg_running)
            self.batch_waiting.labels(*labels).set(bg_waiting)
            self.kv_usage.labels(*labels).set(kv)
        sats = {e: _interactive_saturation(v, self.max_num_seqs) for e, v in self._gauges.items()}
        self.saturation.labels(*self._labels(engine)[0]).set(sats[engine])
        if self.num_engines > 1:  # KV usage and saturation are means (a pool each)
            self.saturation.labels(self.model, "total").set(sum(sats.values()) / self.num_engines)

    def _gauge_sets(self, engine: int) -> list[tuple[tuple[str, ...], tuple]]:
        """The engine's numbers under its labels and, with replicas, the totals (KV a mean)."""
        out = [(self._labels(engine)[0], self._gauges[engine])]
        if self.num_engines > 1:
            cols = list(zip(*self._gauges.values(), strict=True))
            total = [sum(c) for c in cols]
            total[2] /= self.num_engines
            total[5] /= self.num_engines
            out.append(((self.model, "total"), tuple(total)))
        return out

    def on_step(self, core: EngineCoreOutputs, outs: list[RequestOutput], engine: int = 0) -> None:
        e = engine
        self._set_gauges(e, core)
        self._count_total(self.preemptions, core.num_preemptions_total, e)
        self._count_total(self.prefix_queries, core.prefix_cache_queries, e)
        self._count_total(self.prefix_hits, core.prefix_cache_hits, e)
        self._count_total(self.spec_drafts, core.spec_num_drafts, e)
        self._count_total(self.kv_transfers, core.kv_transfers, e)
        self._count_total(self.kv_transfer_failures, core.kv_transfer_failures, e)
        self._count_total(self.kv_transfer_bytes, core.kv_transfer_bytes, e)
        self._count_total(self.kv_transfer_seconds, core.kv_transfer_seconds, e)
        self._count_total(self.kv_leases_expired, core.kv_leases_expired, e)
        self._count_total(self.spec_draft_tokens, core.spec_num_draft_tokens, e)
        self._count_total(self.spec_accepted, core.spec_num_accepted_tokens, e)
        for pos, total in enumerate(core.spec_accepted_per_position):
            self._count_total(self.spec_accepted_pos, total, e, str(pos))
        if core.iteration_tokens:
            self._observe(self.iteration_tokens, core.iteration_tokens, e)
        now = time.monotonic()
        for out in outs:
            c = out.outputs[0]
            new = len(c.delta_token_ids)
            if new:
                self._inc(self.generation_tokens, new, e)
            rid, met = out.request_id, out.metrics
            last = self._last_token_time.get(rid)
            timed = not met.background  # (a batch line's latencies are no interactive SLO's)
            if last is None and new:
                if met.time_to_first_token is not None and timed:
                    self._observe(self.ttft, met.time_to_first_token, e)
                if met.queue_time is not None and timed:
                    self._observe(self.queue, met.queue_time, e)
                self._inc(self.prompt_tokens, len(out.prompt_token_ids), e)
            elif last is not None and new:
                if timed:
                    self._observe(self.itl, (now - last) / new, e)
            elif out.embedding is not None:  # an embedding: its prompt computed, no token sampled
                if met.queue_time is not None and timed:
                    self._observe(self.queue, met.queue_time, e)
                self._inc(self.prompt_tokens, len(out.prompt_token_ids), e)
            if out.finished:
                self._finished(out, e)
            elif new:
                self._last_token_time[rid] = now
                self._engine_of[rid] = e

    def on_abort(self, out: RequestOutput, engine: int = 0) -> None:
        """A request the server ended (client gone, --request-timeout): the core reports no
        finish for it, so it is counted here, as vLLM counts it (finished_reason "abort"), and
        what was kept for its next token is dropped."""
        self._finished(out, engine)

    def _finished(self, out: RequestOutput, engine: int) -> None:
        self._last_token_time.pop(out.request_id, None)
        self._engine_of.pop(out.request_id, None)
        self._inc(self.success, 1, engine, out.outputs[0].finish_reason)
        met = out.metrics
        self._observe(self.request_prompt, len(out.prompt_token_ids), engine)
        generated = len(out.outputs[0].token_ids)
        self._observe(self.request_generation, generated, engine)
        if met.background:  # a batch line: counted, but its latencies are no interactive SLO's
            return
        if met.e2e_latency is not None:
            self._observe(self.e2e, met.e2e_latency, engine)
        started, first, done = met.first_scheduled_time, met.first_token_time, met.finished_time
        if started is not None and first is not None:
            self._observe(self.prefill_time, first - started, engine)
        if first is not None and done is not None:
            self._observe(self.decode_time, done - first, engine)
            if generated > 1:
                self._observe(self.request_tpot, (done - first) / (generated - 1), engine)
        if started is not None and done is not None:
            self._observe(self.inference_time, done - started, engine)

    def on_core_lost(self, engine: int = 0) -> None:
        """An engine core died: its gauges no longer hold, and a new core's running totals
        start from zero again (the counters keep what they counted)."""
        self._set_gauges(engine)
        self._seen = {k: v for k, v in self._seen.items() if k[1] != engine}
        for rid in [r for r, owner in self._engine_of.items() if owner == engine]:
            self._last_token_time.pop(rid, None)
            del self._engine_of[rid]

    def _refresh_pending(self) -> None:
        if self.pending_prefill is None:
            return
        per_engine = self.pending_prefill()
        for e, tokens in enumerate(per_engine):
            self.waiting_prefill.labels(*self._labels(e)[0]).set(tokens)
        if self.num_engines > 1:
            self.waiting_prefill.labels(self.model, "total").set(sum(per_engine))

    def render(self) -> bytes:
        self._refresh_pending()
        return generate_latest(self.registry)


def waiting_prefill_tokens(engine) -> list[int]:
    """Per engine replica, its `waiting_prefill_tokens` (under data parallelism net of what
    the router expected to find in the replica's prefix cache)."""
    engines = getattr(engine, "engines", [engine])
    return [e.waiting_prefill_tokens for e in engines]


def _interactive_saturation(vals: tuple, max_num_seqs: int) -> float:
    """saturation.py's formula over the interactive requests: the batch lines' seats, queue and
    KV blocks left out (an interactive request takes them at once)."""
    running, waiting, kv, bg_running, bg_waiting, bg_kv = vals
    return saturation(running - bg_running, waiting - bg_waiting, max(0.0, kv - bg_kv), max_num_seqs)
