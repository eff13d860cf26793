"""Continuous batching: decides, every step, which requests run and how many tokens each.

Policy (one function, `schedule`): running requests first, in order — each gets its next
prefill chunk or one decode token; then waiting requests join while the step's token budget
and the seat limit allow, starting after the longest prefix already in the KV cache. A
prompt larger than the remaining budget is split (chunked prefill), so prefill chunks and
decode tokens share one forward pass. When the KV pool runs out, the last running request
is preempted by recompute: its blocks are freed and it goes back to the waiting queue.

Order: "fcfs" keeps admission order (the most recently admitted is preempted first);
"priority" orders by (priority, arrival) — lower runs sooner — so the lowest-priority request
is the one preempted, and a waiting request may preempt a running one of lower priority when
seats or blocks are short.

Background requests (priority BACKGROUND_PRIORITY: batch jobs) come last under either policy:
"fcfs" keeps two tiers, everyone else first in admission order, then the background ones, so a
waiting interactive request takes a seat or blocks from a running background one at once.
While any other request is running or waiting, background requests get no tokens at all
(they keep their blocks and resume when the others are done): a step full of batch decodes
would otherwise slow every interactive step down. For BACKGROUND_QUIET_S after the others
were last present, background-only steps take at most BACKGROUND_STEP_TOKENS tokens, so a
human who comes back waits for a short step; after that they get the whole budget.

Steady inter-token latency: with `long_prefill_token_threshold` set, a step in which any
running request decodes takes at most that many prefill tokens in all (running chunks and
admissions), so a long prompt is split over several steps instead of making one step, and
every stream's next token, wait for all of it. Without decodes prefill gets the whole budget.

Speculative decoding: a decoding request that carries proposed tokens is scheduled with them
(1 + k tokens, within the budget) and its slots for them are allocated as lookahead, never
registered in the prefix cache. If the pool is short, the proposals are dropped before
anything is preempted. `update` then advances by the accepted tokens only; the rejected
positions' KV is simply overwritten later (attention never reads past a request's length).

Prefill/decode disaggregation (kv_transfer/): with a connector, a waiting request whose prompt
KV another engine holds gets blocks for it (after its local cache hits) and waits in
WAITING_FOR_REMOTE_KV, outside the queue and without a seat, until the engine core reports the
fetch done (`finish_remote_load`): it rejoins the queue at the front with those tokens computed,
or, if the fetch failed, with its blocks freed to compute the prompt here. A producer's request
that finishes normally hands its blocks to the connector (a lease) instead of freeing them.

Beam search (engine/beam_search.py) adds two things: a running request with nothing to
compute (a beam whose next token waits for the rest of its group) is skipped, keeping its
blocks; and `add_fork` puts a forked beam next to its parent, sharing the parent's blocks.
The block copies copy-on-write queued while allocating travel with the step's output.
"""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass, field

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.model.layers.empty_rows import NO_TOKEN, no_token_error
from kvserve.model.layers.sampler import SampleResult
from kvserve.request import RemoteKV, Request, RequestStatus

POLICIES = ("fcfs", "priority")
# For this long after other requests were last present, steps of background requests only are
# kept this small, so an interactive request that arrives waits for a short step, not a full one.
BACKGROUND_QUIET_S = 2.0
BACKGROUND_STEP_TOKENS = 32


@dataclass
class SpecDecodeStats:
    """Running totals of speculative decoding, as the metrics report them."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft:
            self.accepted_per_position += [0] * (num_draft - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1


@dataclass
class SchedulerOutput:
    """One step's work: (request, number of new tokens to compute) in batch order."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    num_preempted: int = 0
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before the forward
    replaced_tables: set[str] = field(default_factory=set)  # request ids whose tables changed in place

    @property
    def total_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class WaitingQueue:
    """Requests waiting for a seat, kept in the order the policy serves them."""

    def __init__(self, policy: str) -> None:
        self.priority = policy == "priority"
        self._items: list[tuple[tuple, Request]] = []
        self._seq = itertools.count()

    def _key(self, req: Request, front: bool) -> tuple:
        order = -next(self._seq) if front else next(self._seq)
        return (req.priority, req.arrival_time, order) if self.priority else (req.background, order)

    def add(self, req: Request, front: bool = False) -> None:
        bisect.insort(self._items, (self._key(req, front), req), key=lambda x: x[0])

    def peek(self) -> Request:
        return self._items[0][1]

    def pop(self) -> Request:
        return self._items.pop(0)[1]

    def remove(self, req: Request) -> None:
        self._items = [x for x in self._items if x[1] is not req]

    def __len__(self) -> int:
        return len(self._items)

    def num_background(self) -> int:
        """How many background requests wait (sorted last: counted from the end, no scan)."""
        n = 0
        while n < len(self._items) and self._items[-1 - n][1].background:
            n += 1
        return n

    def __iter__(self):
        return (r for _, r in self._items)

    def __contains__(self, req: Request) -> bool:
        return any(r is req for _, r in self._items)


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: str = "fcfs",
        long_prefill_token_threshold: int = 0,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy: {policy!r} is not one of {POLICIES}")
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        # While requests decode, prefill tokens per step are capped at this (0: no cap).
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.waiting = WaitingQueue(policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self.num_lookahead_slots = 0  # draft-model speculation writes this far ahead
        self.spec_stats = SpecDecodeStats()
        self._interactive_seen = -1e9  # monotonic time other requests were last present
        # Prefill/decode disaggregation (kv_transfer/): set by the engine core when configured.
        self.connector = None
        self.waiting_for_kv: dict[str, Request] = {}  # their prompt's blocks are on the way

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_kv)

    def num_waiting_background(self) -> int:
        """Batch lines waiting for a seat (the core's load report leaves them out)."""
        return self.waiting.num_background()

    def _rank(self, req: Request) -> tuple:
        return (req.priority, req.arrival_time) if self.policy == "priority" else (req.background,)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        # The last one is the first to give way (a stable sort: fcfs keeps admission order per tier).
        self.running.sort(key=self._rank)
        self._preempt_for_priority(out)
        preempted_by_priority = out.num_preempted
        hold_background = self._interactive_present()
        now = time.monotonic()
        if hold_background:
            self._interactive_seen = now
        elif now - self._interactive_seen < BACKGROUND_QUIET_S:
            budget = min(budget, BACKGROUND_STEP_TOKENS)

        prefill_budget = self._prefill_budget(budget, hold_background)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if hold_background and req.background:
                break  # sorted last: the rest are background too; they keep their blocks and wait
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new == 0:  # a beam waiting for its group's next tokens: nothing to compute
                i += 1
                continue
            if num_new > 1:  # a prefill chunk (decodes and speculation are 1 here)
                num_new = min(num_new, prefill_budget)
                if num_new == 0:
                    i += 1
                    continue
                prefill_budget -= num_new
            num_spec = min(len(req.spec_token_ids), budget - num_new) if num_new == 1 else 0
            while not self._allocate(req, num_new, num_spec):
                victim = self.running.pop()  # last in order; not yet scheduled this step
                self._preempt(victim)
                out.num_preempted += 1
                if victim is req:
                    break
            else:
                num_new += len(req.spec_token_ids)  # what _allocate kept
                scheduled.append((req, num_new))
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted: everything after it is gone too

        # After running out of blocks the pool is full: admitting now would only preempt again.
        admit = out.num_preempted == preempted_by_priority
        while (
            admit
            and self.waiting
            and min(budget, prefill_budget) > 0
            and len(self.running) < self.max_num_seqs
        ):
            req = self.waiting.peek()
            if hold_background and req.background:
                break
            if len(self.running) + self._seats(req) > self.max_num_seqs:
                break  # a group's first request: its forks will need their seats too
            if self.connector is not None and req.remote_kv is None and req.num_computed_tokens == 0:
                started = self._start_remote_load(req)
                if started is None:
                    break  # the pool is short
                if started:
                    continue
            # Mean pooling needs every prompt row computed, so it takes no cached prefix.
            fresh = req.num_computed_tokens == 0 and req.params.pooling != "mean"
            hits = self.kv.get_computed_blocks(req) if fresh else []
            num_cached = len(hits) * self.kv.block_size
            num_new = min(req.num_tokens - req.num_computed_tokens - num_cached, budget)
            if num_new > 1:
                num_new = min(num_new, prefill_budget)
                prefill_budget -= num_new
            if not self._allocate(req, num_new, 0, hits):
                break
            self.waiting.pop()
            req.num_computed_tokens += num_cached
            if req.status == RequestStatus.WAITING:  # first admission, not a resumed preemption
                remote = req.remote_kv
                if remote is not None and remote.loaded:  # tokens another engine computed count as cached
                    req.num_cached_tokens = remote.local_tokens + remote.remote_tokens
                    self.kv.record_query(req.num_prompt_tokens, remote.local_tokens)
                else:
                    req.num_cached_tokens = num_cached
                    self.kv.record_query(req.num_prompt_tokens, num_cached)
                req.first_scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, num_new))
            budget -= num_new

        out.scheduled = scheduled
        out.block_copies, out.replaced_tables = self.kv.take_copies()
        return out

    def _start_remote_load(self, req: Request) -> bool | None:
        """Prefill/decode disaggregation: if another engine holds this waiting request's prompt
        KV (beyond the local cache hits), allocate its blocks and start fetching them; the
        request waits outside the queue until `finish_remote_load`. Returns True when started,
        False to compute the prompt here, None when the pool is short."""
        hits = self.kv.get_computed_blocks(req) if req.params.pooling != "mean" else []
        local = len(hits) * self.kv.block_size
        num_remote = self.connector.num_remote_tokens(req, local)
        if num_remote <= 0:
            req.remote_kv = RemoteKV(local, 0)  # tried once: computed here from now on
            return False
        if not self.kv.allocate_for_remote(req, hits, local + num_remote, headroom=len(self.running)):
            return None
        self.waiting.pop()
        req.remote_kv = RemoteKV(local, num_remote)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.waiting_for_kv[req.request_id] = req
        self.connector.start_load(req, len(hits), self.kv.blocks_needed(local + num_remote) - len(hits))
        return True

    def finish_remote_load(self, req: Request, ok: bool) -> None:
        """The fetch ended: written (the request resumes after the loaded tokens) or failed
        (its blocks go back and it computes its prompt here, from its local cache hits)."""
        del self.waiting_for_kv[req.request_id]
        if ok:
            req.num_computed_tokens = req.remote_kv.local_tokens + req.remote_kv.remote_tokens
            req.remote_kv.loaded = True
            self.kv.commit_remote(req)
        else:
            self.kv.free(req)
        req.status = RequestStatus.WAITING
        self.waiting.add(req, front=True)

    def _prefill_budget(self, budget: int, hold_background: bool) -> int:
        """Prefill tokens this step may take: all of `budget`, or, while any running request
        decodes, `long_prefill_token_threshold` (vLLM's idea): a long prompt then arrives a
        chunk per step instead of stalling every stream for one long step."""
        cap = self.long_prefill_token_threshold
        if cap <= 0:
            return budget
        decoding = any(
            r.num_computed_tokens >= r.num_tokens - 1 and not (hold_background and r.background)
            for r in self.running
        )
        return min(budget, cap) if decoding else budget

    def _interactive_present(self) -> bool:
        """Any request not in the background tier running or waiting (both are sorted so
        background requests come last)."""
        if self.running and not self.running[0].background:
            return True
        return bool(self.waiting) and not self.waiting.peek().background

    def add_fork(self, child: Request, parent: Request) -> None:
        """A request forked from `parent` (same tokens, see Request.fork): it shares the
        parent's blocks and takes its place in the queues right after it."""
        self.requests[child.request_id] = child
        self.kv.fork(parent, child)
        if parent in self.running:
            self.running.insert(self.running.index(parent) + 1, child)
        else:
            self.waiting.add(child, front=True)

    @staticmethod
    def _seats(req: Request) -> int:
        """Seats a request needs at admission: a beam group's root n, a sampling leader one per
        sibling waiting to fork from it (engine/sample_groups.py), others one."""
        if req.params.use_beam_search and not req.output_token_ids:
            return req.params.n
        return 1 + len(req.followers)

    def _allocate(self, req: Request, num_new: int, num_spec: int, hits: list[int] = ()) -> bool:
        """Slots for num_new tokens plus num_spec proposed ones (and the draft's lookahead
        once the request samples); falls back to dropping the proposals. Leaves
        req.spec_token_ids as the proposals that will run."""
        done = req.num_computed_tokens + len(hits) * self.kv.block_size + num_new >= req.num_tokens
        ahead = num_spec + (self.num_lookahead_slots if done else 0)
        if ahead and self.kv.allocate_slots(req, num_new, hits, num_lookahead_tokens=ahead):
            req.spec_token_ids = req.spec_token_ids[:num_spec]
            return True
        req.spec_token_ids = []
        return self.kv.allocate_slots(req, num_new, hits)

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """Make room for a better waiting request by preempting worse running ones."""
        while self.waiting and self.running:
            cand, worst = self.waiting.peek(), self.running[-1]
            if self._rank(worst) <= self._rank(cand):
                return
            need = self.kv.blocks_needed(min(cand.num_tokens, self.max_num_batched_tokens))
            if len(self.running) < self.max_num_seqs and self.kv.num_free_blocks >= need:
                return
            self.running.pop()
            self._preempt(worst)
            out.num_preempted += 1

    def preempt(self, req: Request) -> None:
        """Send a running request back to wait, to be recomputed (used after a failed step)."""
        if req in self.running:
            self.running.remove(req)
            self._preempt(req)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.add(req, front=True)

    def update(self, out: SchedulerOutput, sampled: dict[str, SampleResult]) -> list[tuple[Request, int]]:
        """Advance computed counts, append sampled tokens (several when speculative tokens
        were accepted), retire finished requests.

        Returns (request, number of new tokens) for the requests that received tokens.
        """
        progressed = []
        for req, n in out.scheduled:
            num_spec = max(0, req.num_computed_tokens + n - req.num_tokens)  # proposals verified
            req.num_computed_tokens += n - num_spec
            req.spec_token_ids = []
            result = sampled.get(req.request_id)
            if result is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            if num_spec:
                num_accepted = len(result.token_ids) - 1
                req.num_computed_tokens += num_accepted  # their KV was written and is right
                self.spec_stats.record(num_spec, num_accepted)
                if req.spec_state is not None:
                    req.spec_state.record(num_spec, num_accepted)
            count = 0
            ranks = result.ranks or [None] * len(result.token_ids)
            for token, lp, rank in zip(result.token_ids, result.logprobs, ranks):
                if token == NO_TOKEN:  # its own masks left nothing to sample (empty_rows.py)
                    self._end_without_token(req)
                    break
                req.append_token(token)
                if req.grammar is not None:  # [structured outputs] advance the matcher (see check_stop)
                    req.grammar.accept_sampled(token)
                if lp is not None:
                    req.logprobs.append(lp)
                    req.logprob_ranks.append(rank)
                count += 1
                if req.check_stop(self.max_model_len):
                    self._retire(req)
                    break
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            progressed.append((req, count))
        return progressed

    def _end_without_token(self, req: Request) -> None:
        """A request with nothing left to sample: "stop" where its grammar may end there (only
        the end was allowed, and allowed_token_ids left it out), else the client's error."""
        if req.grammar is not None and req.grammar.may_end():
            req.status = RequestStatus.FINISHED_STOPPED
        else:
            req.status = RequestStatus.FINISHED_ERROR
            req.stop_reason = no_token_error(req)
        self._retire(req)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request from outside the step (abort, stop string); frees its blocks now."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        req.status = status
        if req in self.waiting:
            self.waiting.remove(req)
        pulling = self.waiting_for_kv.pop(request_id, None) is not None
        if self.connector is not None and (pulling or req.remote_kv is None):
            self.connector.cancel(req)  # the producer frees its lease now (pulled or not yet asked for)
        self._retire(req)
        return req

    def _retire(self, req: Request) -> None:
        req.finished_time = time.monotonic()
        if req in self.running:
            self.running.remove(req)
        if self.connector is not None and req.status in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
        ):
            blocks = self.kv.detach(req)
            kept, req.kv_transfer_out = self.connector.request_finished(req, blocks)
            if not kept:  # (a producer keeps them under a lease until a consumer has them)
                self.kv.free_blocks(blocks)
        else:
            self.kv.free(req)
        self.requests.pop(req.request_id, None)
