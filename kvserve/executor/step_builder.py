"""Turns the scheduler's decision (live `Request`s) into a serializable `StepInput` delta.

It remembers what the workers were told about each request (tokens, blocks, preemptions) and
sends only what changed: a request whole the first time it runs, then its new tokens and
blocks; after a preemption, or once copy-on-write replaced one of its blocks, its whole new
block table; ids of requests that ended since; the block copies to make before the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.core.scheduler import SchedulerOutput
from kvserve.request import Request
from kvserve.worker.step_input import NewRequestData, ScheduledRequest, StepInput


@dataclass
class _Sent:
    req: Request
    num_tokens: int
    num_blocks: int
    num_preemptions: int


class StepBuilder:
    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def build(self, sched: SchedulerOutput, block_tables: dict[str, list[int]]) -> StepInput:
        step = StepInput(
            [], [], [rid for rid, s in self._sent.items() if s.req.is_finished], sched.block_copies
        )
        for rid in step.finished_req_ids:
            del self._sent[rid]
        for req, n in sched.scheduled:
            rid, table = req.request_id, block_tables[req.request_id]
            sent = self._sent.get(rid)
            if sent is None or sent.req is not req:
                if sent is not None:  # the id was reused by a new request: drop the old one first
                    step.finished_req_ids.append(rid)
                step.new_requests.append(
                    NewRequestData(rid, req.prompt_token_ids, req.params.prompt_logprobs, req.params.pooling)
                )
                sent = self._sent[rid] = _Sent(req, req.num_prompt_tokens, 0, req.num_preemptions)
            resumed = sent.num_preemptions != req.num_preemptions or rid in sched.replaced_tables
            step.scheduled.append(
                ScheduledRequest(
                    rid,
                    n,
                    req.num_computed_tokens,
                    req.all_token_ids[sent.num_tokens :],
                    table if resumed else table[sent.num_blocks :],
                    resumed,
                    req.spec_token_ids,
                )  # fmt: skip
            )
            sent.num_tokens, sent.num_blocks, sent.num_preemptions = (
                req.num_tokens,
                len(table),
                req.num_preemptions,
            )
        return step
