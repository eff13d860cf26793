"""Continuous batching: decides, every step, which requests run and how many tokens each.

Policy (one function, `schedule`): running requests first, in admission order — each gets
its next prefill chunk or one decode token; then waiting requests join while the step's
token budget and the seat limit allow. A prompt larger than the remaining budget is split
(chunked prefill), so prefill chunks and decode tokens share one forward pass. When the KV
pool runs out, the most recently admitted running request is preempted by recompute: its
blocks are freed and it goes back to the head of the waiting queue.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """One step's work: (request, number of new tokens to compute) in batch order."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def total_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running.pop()  # most recently admitted; not yet scheduled
                self._preempt(victim)
                out.num_preempted += 1
                if victim is req:
                    break
            else:
                scheduled.append((req, num_new))
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted: everything after it is gone too

        # After a preemption the pool is full: admitting now would only preempt again.
        while not out.num_preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.allocate_slots(req, num_new):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            scheduled.append((req, num_new))
            budget -= num_new

        out.scheduled = scheduled
        return out

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed counts, append sampled tokens, retire finished requests.

        Returns the requests that received a new token this step.
        """
        progressed = []
        for req, n in out.scheduled:
            req.num_computed_tokens += n
            token = sampled.get(req.request_id)
            if token is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            req.append_token(token)
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            progressed.append(req)
            if req.check_stop(self.max_model_len):
                self._retire(req)
        return progressed

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request from outside the step (abort, stop string); frees its blocks now."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        req.status = status
        if req in self.waiting:
            self.waiting.remove(req)
        self._retire(req)
        return req

    def _retire(self, req: Request) -> None:
        req.finished_time = time.monotonic()
        if req in self.running:
            self.running.remove(req)
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
