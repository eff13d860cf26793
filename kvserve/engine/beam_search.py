"""Beam search in the engine core: beam groups whose beams are scheduler requests sharing KV
blocks copy-on-write.

A caller asks for width-k beam search the way it asks for n samples: k requests with
`use_beam_search`, n = k and one group id (none when k = 1). The first to arrive becomes the
group's root beam and is scheduled; the others are only the slots the k best sequences are
returned under, best first. The root prefills the prompt once. Then, every time all live
beams of a group have their next-token candidates (driver_sampler.beam_candidates), one
search step (beam_scoring.py) picks the continuations: a beam continued once keeps its
request and appends the token; continued several times, it is forked first (Request.fork,
Scheduler.add_fork: the child shares all the parent's blocks and copies only the partly
filled last block when it writes there); a beam not continued is freed. So k beams over a
long prompt hold the prompt's blocks once.

Beams move in lockstep: a beam that has its candidates while a sibling has not (preempted,
or out of this step's token budget) computes nothing (the scheduler skips requests with no
token to compute) until the group steps. Nothing of a group is sent out before it ends; then
each slot gets its sequence as one output, with finish_reason "stop" (a stop token ended it)
or "length". Internal beam ids are "<group>#beam<i>".
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from kvserve.core.scheduler import Scheduler
from kvserve.engine.beam_scoring import BeamSearchState, Hypothesis
from kvserve.engine.messages import EngineCoreOutput
from kvserve.model.layers.sampler import SampleResult
from kvserve.request import Request, RequestStatus


@dataclass
class BeamGroup:
    key: str
    width: int
    state: BeamSearchState
    root: Request
    members: list[str] = field(default_factory=list)  # the caller's ids, in arrival order
    beams: dict[str, float] = field(default_factory=dict)  # live beam id -> cumulative logprob
    candidates: dict[str, SampleResult] = field(default_factory=dict)  # this depth's, per beam
    depth: int = 0  # tokens every live beam has generated
    results: list[EngineCoreOutput] | None = None  # once done, one per rank (best first)
    num_sent: int = 0  # members that got their result
    ids: itertools.count = field(default_factory=itertools.count)
    first_token_time: float | None = None

    def new_beam_id(self) -> str:
        return f"{self.key}#beam{next(self.ids)}"


class BeamSearchManager:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.groups: dict[str, BeamGroup] = {}  # group key -> group
        self.member_group: dict[str, str] = {}  # caller's request id -> group key
        self.beam_group: dict[str, str] = {}  # live beam id -> group key
        self._pending: list[EngineCoreOutput] = []  # results for members that arrived late

    def owns(self, request_id: str) -> bool:
        return request_id in self.member_group

    def has_pending(self) -> bool:
        return bool(self._pending)

    def add(self, request: Request) -> None:
        """A member of a beam group (its request id is a result slot); the first one starts
        the search."""
        key = request.group_id or request.request_id
        group = self.groups.get(key)
        if group is None:
            p = request.params
            stops = request.eos_token_ids | request.stop_token_ids
            state = BeamSearchState(p.n, request.max_tokens, stops, p.length_penalty, p.early_stopping)
            group = self.groups[key] = BeamGroup(key, p.n, state, request)
            root = request.fork(group.new_beam_id())
            group.root = root
            group.beams[root.request_id] = 0.0
            self.beam_group[root.request_id] = key
            self.scheduler.add_request(root)
        group.members.append(request.request_id)
        self.member_group[request.request_id] = key
        if group.results is not None:
            self._send_ready(group)

    def collect(self, sampled: dict[str, SampleResult]) -> None:
        """Take the beams' candidates out of a step's results (they are not tokens to append)."""
        for rid in [r for r in sampled if r in self.beam_group]:
            result = sampled.pop(rid)
            group = self.groups[self.beam_group[rid]]
            group.candidates[rid] = result

    def advance(self) -> list[EngineCoreOutput]:
        """Step every group whose live beams all have candidates; outputs of groups that ended."""
        for group in list(self.groups.values()):
            if group.results is None and group.beams and group.candidates.keys() >= group.beams.keys():
                self._step(group)
        return self.drain()

    def _step(self, group: BeamGroup) -> None:
        sched = self.scheduler
        ids = list(group.beams)
        reqs = [sched.requests[b] for b in ids]
        cands = [group.candidates[b] for b in ids]
        beams = [
            (r.output_token_ids, group.beams[b], c.token_ids, c.beam_logprobs)
            for b, r, c in zip(ids, reqs, cands)
        ]
        chosen = group.state.step(beams, group.depth)
        group.candidates = {}
        group.depth += 1
        if group.first_token_time is None:
            group.first_token_time = time.monotonic()
        if group.state.done:
            self._finish(group, [(r.output_token_ids, group.beams[b]) for b, r in zip(ids, reqs)])
            return
        by_parent: dict[int, list] = {}
        for c in chosen:
            by_parent.setdefault(c.parent, []).append(c)
        live: dict[str, float] = {}
        for i, (bid, req) in enumerate(zip(ids, reqs)):
            conts = by_parent.get(i)
            if not conts:
                self._free(bid)
                continue
            for c in conts[1:]:  # fork before the parent appends its own token
                child = req.fork(group.new_beam_id())
                sched.add_fork(child, req)
                self.beam_group[child.request_id] = group.key
                child.append_token(c.token)
                live[child.request_id] = c.cum_logprob
            req.append_token(conts[0].token)
            live[bid] = conts[0].cum_logprob
        group.beams = live

    def _finish(self, group: BeamGroup, running: list[tuple[list[int], float]]) -> None:
        """Free the beams; the `width` best hypotheses become the members' results."""
        for bid in list(group.beams):
            self._free(bid)
        group.beams = {}
        hyps = list(group.state.finished)
        for tokens, cum in running:  # only if fewer hypotheses finished than beams asked for
            if len(hyps) >= group.width:
                break
            hyps.append(Hypothesis(list(tokens), cum, "length", cum_logprob=cum))
        now = time.monotonic()
        root = group.root
        group.results = [
            EngineCoreOutput(
                "",
                h.token_ids,
                finish_reason=h.finish_reason,
                stop_reason=h.stop_token if h.stop_token in root.stop_token_ids else None,
                first_scheduled_time=root.first_scheduled_time,
                first_token_time=group.first_token_time,
                finished_time=now,
                num_cached_tokens=root.num_cached_tokens,
                cumulative_logprob=h.cum_logprob,
            )  # fmt: skip
            for h in hyps
        ]
        self._send_ready(group)

    def _send_ready(self, group: BeamGroup) -> None:
        while group.num_sent < len(group.members):
            rid = group.members[group.num_sent]
            if group.num_sent < len(group.results):
                template = group.results[group.num_sent]
                out = EngineCoreOutput(
                    rid, template.new_token_ids, template.finish_reason, template.stop_reason,
                    first_scheduled_time=template.first_scheduled_time,
                    first_token_time=template.first_token_time, finished_time=template.finished_time,
                    num_cached_tokens=template.num_cached_tokens,
                    cumulative_logprob=template.cumulative_logprob,
                )  # fmt: skip
            else:  # more slots than beams: nothing to return there
                out = EngineCoreOutput(rid, [], finish_reason="abort")
            self._pending.append(out)
            del self.member_group[rid]
            group.num_sent += 1
        if group.num_sent >= group.width:
            del self.groups[group.key]

    def _free(self, beam_id: str) -> None:
        self.beam_group.pop(beam_id, None)
        self.scheduler.finish_request(beam_id, RequestStatus.FINISHED_ABORTED)

    def abort(self, request_id: str, reason: str = "abort", message: str | None = None) -> None:
        """End the whole group of this member (or beam) now; every member still waiting gets
        `reason`."""
        key = self.member_group.get(request_id) or self.beam_group.get(request_id)
        group = self.groups.pop(key, None) if key is not None else None
        if group is None:
            return
        for bid in list(group.beams):
            self._free(bid)
        for rid in group.members[group.num_sent :]:
            self.member_group.pop(rid, None)
            self._pending.append(EngineCoreOutput(rid, [], finish_reason=reason, stop_reason=message))

    def translate(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Outputs the engine made for internal beam ids (a failed step's errors) become the
        group's: the search cannot go on without that beam."""
        kept = []
        for out in outputs:
            if "#beam" in out.request_id and out.request_id in self.beam_group:
                self.abort(out.request_id, out.finish_reason or "error", out.stop_reason)
            else:
                kept.append(out)
        return kept

    def drain(self) -> list[EngineCoreOutput]:
        """Outputs waiting to be sent (late members, aborted groups)."""
        out, self._pending = self._pending, []
        return out
