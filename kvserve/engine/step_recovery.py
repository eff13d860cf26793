"""Poison-request isolation: when a step raises, fail only the request(s) that caused it.

A step that raises has changed nothing the scheduler relies on: `Scheduler.update` never ran,
so every request's `num_computed_tokens` is what it was, and re-running a request's part of
the step recomputes the same KV into the same slots. So the engine re-runs each scheduled
request on its own to find the ones that fail alone, ends those with finish_reason "error"
and the exception's message, and lets the rest run again in the next step. The probes sample,
so the seeded requests' generators (and their waiting n > 1 siblings') are put back as they
were: a survivor's tokens, greedy or seeded, are those it gives without the failure. If no
request fails alone, the failure needs the combination, and every request
of that step is failed instead: the engine keeps serving everyone else.

Blocks are registered in the prefix cache when a step is scheduled, before it computes, so
the blocks the failed step should have filled are uncached first; a survivor whose computed
prefix lies in a failed request's uncomputed blocks (a same-step cache hit) is recomputed.
Errors that mean the process itself is broken (out of memory) are re-raised: the core stops
and its supervisor restarts it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from kvserve.core.scheduler import SchedulerOutput
from kvserve.engine.messages import EngineCoreOutput
from kvserve.executor.multiproc import RankFailure
from kvserve.request import RequestStatus

if TYPE_CHECKING:
    from kvserve.engine.core import EngineCore

logger = logging.getLogger(__name__)


def is_unrecoverable(error: BaseException) -> bool:
    """Errors after which no step can be trusted (out of memory, a dead or hung rank): the
    core must stop, and its supervisor restarts it."""
    return isinstance(error, (MemoryError, torch.OutOfMemoryError, RankFailure))


def recover_failed_step(
    core: EngineCore, sched: SchedulerOutput, block_tables: dict[str, list[int]], error: Exception
) -> list[EngineCoreOutput]:
    """Find the request(s) behind `error`, end them with an error output, keep the rest."""
    if is_unrecoverable(error):
        raise error
    scheduled = list(sched.scheduled)
    seeded = [r for req, _ in scheduled for r in (req, *req.followers) if r.generator is not None]
    rng_states = [(r.generator, r.generator.get_state()) for r in seeded]
    culprits = {}
    if len(scheduled) == 1:
        culprits[scheduled[0][0].request_id] = error
    else:
        for req, n in scheduled:
            try:
                core.executor.execute_model(SchedulerOutput([(req, n)]), block_tables)
            except Exception as e:  # noqa: BLE001 - this request fails on its own
                if is_unrecoverable(e):
                    raise
                culprits[req.request_id] = e
        for generator, state in rng_states:  # the probes drew: the real step must draw the same
            generator.set_state(state)
    if not culprits:
        culprits = {req.request_id: error for req, _ in scheduled}
    logger.error(
        "a step failed (%s: %s); failing %d of its %d request(s): %s",
        type(error).__name__, error, len(culprits), len(scheduled), ", ".join(culprits),
        exc_info=error,
    )  # fmt: skip
    kv = core.kv_cache_manager
    dropped: set[int] = set()
    for req, _ in scheduled:
        blocks = kv.drop_uncomputed(req)
        if req.request_id in culprits:
            dropped.update(blocks)
    outputs = []
    for rid, e in culprits.items():
        core.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR)
        message = f"the engine failed while running this request ({type(e).__name__}: {e})"
        outputs.append(EngineCoreOutput(rid, [], finish_reason="error", stop_reason=message))
    for req, _ in scheduled:
        if req.request_id in culprits:
            continue
        computed = kv.get_block_ids(req.request_id)[: req.num_computed_tokens // kv.block_size]
        if dropped.intersection(computed):
            core.scheduler.preempt(req)
    return outputs
