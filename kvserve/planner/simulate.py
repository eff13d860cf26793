"""A discrete-event model of N kvserve replicas under an autoscaler, for
`kvserve plan --simulate`: pick min replicas and thresholds on a trace before paying for them.

Each replica is modelled as kvserve's scheduler runs it: up to `max_num_seqs` sequences in
the batch, each step computing one token per decoding sequence plus prompt chunks, within
`max_num_batched_tokens`; a step lasts `step_overhead_s + decode_token_s x decoding sequences
+ token_s x prompt tokens`. Decode and prompt tokens cost differently: a decoding sequence is
one row through every weight plus attention over its whole context through the paged kernel,
a prompt token one row of a large matmul; on the 2-core CPU here one more decoding sequence
cost 1.6-1.9x a prompt token (benchmarks/plan_calibrate.py; docs/BENCHMARKS.md, round 6),
and one per-token figure fit to prefill put TTFT p50 on a bursty trace at 0.66-0.68x the
measured.
Fit them on the real hardware from step times: the overhead and decode cost from decode
steps at a few batch sizes, the prompt cost from prefills of a few lengths (`decode_token_s`
None: the same as `token_s`). KV capacity is not modelled (seats only), so size the KV pool
with `kvserve plan MODEL` first.
Requests go to the ready replica with the fewest requests; with none ready they wait at the
front.

The autoscaler acts as an HPA on `kvserve:saturation` (kvserve/metrics/saturation.py):
every `interval_s`, desired = ceil(ready x mean saturation / target), clamped; new replicas
serve after `cold_start_s` (and cost from the moment they start); scale-down waits until
the desired count has been lower for `scale_down_delay_s`, then drains one replica (it takes
no new requests and stops when its last one ends), as the shipped HPA and preStop do.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from kvserve.metrics.saturation import saturation
from kvserve.planner import sim_limits
from kvserve.planner.trace import Arrival


@dataclass(frozen=True)
class ReplicaModel:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    step_overhead_s: float = 0.02
    token_s: float = 0.0002  # per prompt token computed in a step
    decode_token_s: float | None = None  # per decoding sequence in a step; None: token_s

    @property
    def decode_s(self) -> float:
        return self.token_s if self.decode_token_s is None else self.decode_token_s


@dataclass(frozen=True)
class ScalingPolicy:
    min_replicas: int = 1
    max_replicas: int = 8
    target_saturation: float = 0.8
    interval_s: float = 15.0
    cold_start_s: float = 60.0
    scale_down_delay_s: float = 300.0


@dataclass
class _Req:
    a: Arrival
    prefilled: int = 0
    generated: int = 0
    admitted: float | None = None
    first_token: float | None = None
    done: float | None = None


@dataclass
class _Replica:
    started: float
    ready_at: float
    draining: bool = False
    stopped: float | None = None
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    stepping: bool = False

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)


@dataclass
class Result:
    requests: int
    ttft_s: list[float]
    queue_s: list[float]
    makespan_s: float
    replica_hours: float
    peak_replicas: int
    scale_events: int
    output_tokens: int

    def attainment(self, slo_s: float) -> float:
        return sum(t <= slo_s for t in self.ttft_s) / len(self.ttft_s) if self.ttft_s else 1.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else 0.0


def quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


class _Sim:
    def __init__(self, trace: list[Arrival], model: ReplicaModel, policy: ScalingPolicy) -> None:
        self.model, self.policy = model, policy
        self.events: list = []
        self.seq = itertools.count()
        self.reqs = [_Req(a) for a in trace]
        self.replicas = [_Replica(0.0, 0.0) for _ in range(policy.min_replicas)]
        self.pending: deque = deque()  # arrived while no replica was ready
        self.left = len(self.reqs)
        self.low_since: float | None = None
        self.scale_events = 0
        self.deadline = sim_limits.MAX_TICKS * policy.interval_s  # its last autoscaler decision
        self.peak = len(self.replicas)
        for r in self.reqs:
            self.push(r.a.t, "arrive", r)
        self.push(policy.interval_s, "tick", None)

    def push(self, t: float, kind: str, obj) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, obj))

    def ready(self, now: float) -> list[_Replica]:
        return [r for r in self.replicas if r.ready_at <= now and not r.draining and r.stopped is None]

    def route(self, req: _Req, now: float) -> None:
        live = self.ready(now)
        if not live:
            self.pending.append(req)
            return
        rep = min(live, key=lambda r: r.load)
        rep.waiting.append(req)
        self.kick(rep, now)

    def kick(self, rep: _Replica, now: float) -> None:
        if rep.stepping or not rep.load:
            if not rep.load and rep.draining and rep.stopped is None:
                rep.stopped = now
            return
        m = self.model
        while rep.waiting and len(rep.running) < m.max_num_seqs:
            req = rep.waiting.popleft()
            req.admitted = now
            rep.running.append(req)
        budget, plan = m.max_num_batched_tokens, []
        for req in rep.running:  # decodes first, then prompt chunks, as kvserve's scheduler
            if req.prefilled == req.a.prompt_tokens and budget:
                plan.append((req, 1))
                budget -= 1
        for req in rep.running:
            if req.prefilled < req.a.prompt_tokens and budget:
                n = min(budget, req.a.prompt_tokens - req.prefilled)
                plan.append((req, n))
                budget -= n
        decodes = sum(1 for req, _ in plan if req.prefilled == req.a.prompt_tokens)
        prompt_tokens = m.max_num_batched_tokens - budget - decodes
        rep.stepping = True
        duration = m.step_overhead_s + m.decode_s * decodes + m.token_s * prompt_tokens
        if now + duration > self.deadline:  # its requests, unfinished until then, keep the ticks going
            raise sim_limits.runaway(self.left, len(self.reqs), now + duration)
        self.push(now + duration, "step", (rep, plan))

    def step_end(self, rep: _Replica, plan: list, now: float) -> None:
        rep.stepping = False
        for req, n in plan:
            if req.prefilled < req.a.prompt_tokens:
                req.prefilled += n
                if req.prefilled == req.a.prompt_tokens:
                    req.first_token, req.generated = now, 1
            else:
                req.generated += 1
            if req.first_token is not None and req.generated >= req.a.output_tokens:
                req.done = now
                rep.running.remove(req)
                self.left -= 1
        self.kick(rep, now)

    def tick(self, now: float) -> None:
        p, seats = self.policy, self.model.max_num_seqs
        if now > self.deadline:
            raise sim_limits.runaway(self.left, len(self.reqs), now)
        live = self.ready(now)
        active = [r for r in self.replicas if not r.draining and r.stopped is None]  # ready or starting
        if live:
            queued = sum(len(r.waiting) for r in live) + len(self.pending)
            running = sum(len(r.running) for r in live)
            sat = saturation(running, queued, 0.0, seats * len(live))  # the mean over ready replicas
            desired = math.ceil(len(live) * sat / p.target_saturation - 1e-9)
        else:
            desired = len(active) + (1 if self.pending else 0)
        desired = max(p.min_replicas, min(p.max_replicas, desired))
        if desired > len(active):
            for _ in range(desired - len(active)):
                rep = _Replica(now, now + p.cold_start_s)
                self.replicas.append(rep)
                self.push(rep.ready_at, "ready", rep)
            self.scale_events += 1
            self.low_since = None
        elif desired < len(active) and len(live) > p.min_replicas:
            self.low_since = now if self.low_since is None else self.low_since
            if now - self.low_since >= p.scale_down_delay_s:
                victim = min(live, key=lambda r: r.load)
                victim.draining = True
                self.kick(victim, now)
                self.scale_events += 1
                self.low_since = now
        else:
            self.low_since = None
        self.peak = max(self.peak, len([r for r in self.replicas if r.stopped is None]))
        if self.left:
            self.push(now + p.interval_s, "tick", None)

    def run(self) -> Result:
        now = 0.0
        while self.events and self.left:
            now, _, kind, obj = heapq.heappop(self.events)
            if kind == "arrive":
                self.route(obj, now)
            elif kind == "step":
                self.step_end(*obj, now)
            elif kind == "ready":
                while self.pending and self.ready(now):
                    self.route(self.pending.popleft(), now)
            else:
                self.tick(now)
        end = now
        hours = sum(((r.stopped if r.stopped is not None else end) - r.started) for r in self.replicas) / 3600
        done = [r for r in self.reqs if r.first_token is not None]
        return Result(
            requests=len(self.reqs),
            ttft_s=[r.first_token - r.a.t for r in done],
            queue_s=[r.admitted - r.a.t for r in done],
            makespan_s=end - (self.reqs[0].a.t if self.reqs else 0.0),
            replica_hours=hours,
            peak_replicas=self.peak,
            scale_events=self.scale_events,
            output_tokens=sum(r.a.output_tokens for r in done),
        )


def simulate(trace: list[Arrival], model: ReplicaModel, policy: ScalingPolicy) -> Result:
    """Replay the trace; deterministic for a given trace."""
    if policy.min_replicas < 1 or policy.max_replicas < policy.min_replicas:
        raise ValueError("--min-replicas must be >= 1 and <= --max-replicas")
    return _Sim(trace, model, policy).run()


def min_replicas_for_slo(
    trace: list[Arrival], model: ReplicaModel, policy: ScalingPolicy, slo_s: float, target: float
) -> tuple[int | None, int | None]:
    """(fewest fixed replicas, fewest min_replicas under the autoscaler) whose TTFT SLO
    attainment reaches target; None when even max_replicas does not."""
    fixed = auto = None
    for n in range(1, policy.max_replicas + 1):
        if fixed is None:
            pinned = ScalingPolicy(n, n, policy.target_saturation, policy.interval_s, policy.cold_start_s,
                                   policy.scale_down_delay_s)  # fmt: skip
            if simulate(trace, model, pinned).attainment(slo_s) >= target:
                fixed = n
        if auto is None:
            scaled = ScalingPolicy(n, policy.max_replicas, policy.target_saturation, policy.interval_s,
                                   policy.cold_start_s, policy.scale_down_delay_s)  # fmt: skip
            if simulate(trace, model, scaled).attainment(slo_s) >= target:
                auto = n
        if fixed is not None and auto is not None:
            break
    return fixed, auto
