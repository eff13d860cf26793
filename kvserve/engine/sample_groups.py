"""n > 1 sampling from one prefill: the n requests of a group share the prompt's KV by forking.

The first request of a group (its leader) is scheduled; the others wait here. In the step the
leader's prompt is done, the driver sampler draws each waiting sibling's first token from the
leader's logits row with the sibling's own seed (driver_sampler.py); the siblings are then
forked from the leader (KVCacheManager.fork: all its blocks shared, the partly filled last
one copied on first write) and go on as ordinary requests. The leader is admitted only when
there are seats for the whole group. Groups whose requests need state a fork cannot share
(structured outputs, prompt logprobs, embeddings) run as n separate requests sharing their
prompt's full blocks through the prefix cache, as do siblings arriving after the leader has
sampled.
"""

from __future__ import annotations

import time

from kvserve.core.scheduler import Scheduler, SchedulerOutput
from kvserve.model.layers.sampler import SampleResult
from kvserve.request import Request, RequestStatus


class SampleGroups:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.leader_of: dict[str, str] = {}  # group id -> its leader's request id
        self.held: dict[str, Request] = {}  # siblings waiting for their leader's prompt

    @staticmethod
    def forkable(req: Request) -> bool:
        p = req.params
        return (
            req.group_id is not None and not p.use_beam_search and p.structured_outputs is None
            and p.prompt_logprobs is None and p.pooling is None
        )  # fmt: skip

    def add(self, req: Request) -> None:
        """Schedule the request, or hold it for its group's leader."""
        sched = self.scheduler
        leader = sched.requests.get(self.leader_of.get(req.group_id, ""))
        if leader is None or leader.output_token_ids or 1 + len(leader.followers) >= sched.max_num_seqs:
            self.leader_of[req.group_id] = req.request_id
            sched.add_request(req)
            return
        leader.followers.append(req)
        self.held[req.request_id] = req

    def abort(self, request_id: str) -> bool:
        """Drop a held sibling (no output, as for any aborted request); False if not held."""
        req = self.held.pop(request_id, None)
        if req is None:
            return False
        leader = self.scheduler.requests.get(self.leader_of.get(req.group_id, ""))
        if leader is not None:
            leader.followers.remove(req)
        return True

    def fork_followers(self, sched: SchedulerOutput, sampled: dict[str, SampleResult]) -> None:
        """Siblings whose first token was drawn this step join the scheduler as forks of their
        leader, and the step's update appends their tokens (a zero-token share of the step)."""
        now = time.monotonic()
        for leader, n in list(sched.scheduled):
            if not leader.followers or leader.request_id not in sampled:
                continue
            for f in leader.followers:
                self.held.pop(f.request_id, None)
                if f.request_id not in sampled:
                    continue
                f.num_computed_tokens = leader.num_computed_tokens + n  # the prompt, all of it
                f.status = RequestStatus.RUNNING
                f.first_scheduled_time = now
                f.num_cached_tokens = leader.num_cached_tokens
                self.scheduler.add_fork(f, leader)
                sched.scheduled.append((f, 0))
            leader.followers = []
            if self.leader_of.get(leader.group_id) == leader.request_id:
                del self.leader_of[leader.group_id]

    def promote_orphans(self) -> None:
        """A leader that ended before its prompt was done (aborted, failed): its first waiting
        sibling leads the rest."""
        for group_id, rid in list(self.leader_of.items()):
            leader = self.scheduler.requests.get(rid)
            if leader is not None:
                continue
            del self.leader_of[group_id]
            orphans = [r for r in self.held.values() if r.group_id == group_id]
            for r in orphans:
                del self.held[r.request_id]
            for r in orphans:
                self.add(r)
