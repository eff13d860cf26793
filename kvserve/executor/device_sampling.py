"""The engine's half of sampling on the device: which requests the runner may sample where the
logits are (worker/device_sampling.py), and what it needs to: temperature, top-k, top-p and the
grammar bitmask, filled here from the request's matcher, which lives in this process.

On by default on a CUDA device, where it saves the step's [rows, vocab] float32 copy to the
host; off elsewhere (CPU logits are on the host already). KVSERVE_DEVICE_SAMPLING=1 turns it on
on any device (the tests run the device path on the CPU), =0 off.

A request qualifies when sampling it needs no host state: no seed (its generator is on the
host: a seeded request's draws must not depend on the batch or the device), no penalties,
logit bias, allowed_token_ids, bad_words, min-p or min_tokens still in force (they read the
request's history), no logprobs, no beam search, not an n > 1 leader before its first token
(siblings draw from its row). Its row's draws come from the runner's device generator (seeded
with the engine's seed), not from the host sampler's: the distribution is the same, the draws
are not. Greedy rows give the same tokens either way.
"""

from __future__ import annotations

import os

import torch

from kvserve.core.scheduler import SchedulerOutput
from kvserve.model.layers.sampler import fault_injected
from kvserve.request import Request
from kvserve.structured.bitmask import fill_grammar_bitmask
from kvserve.worker.step_input import DeviceSampling

DEVICE_SAMPLING_ENV = "KVSERVE_DEVICE_SAMPLING"


def device_sampling_enabled(device: torch.device) -> bool:
    """On for cuda, off otherwise, unless KVSERVE_DEVICE_SAMPLING is 1 or 0."""
    value = os.environ.get(DEVICE_SAMPLING_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{DEVICE_SAMPLING_ENV}: {value!r} is not 0 or 1")
    return device.type == "cuda" if value == "" else value == "1"


def samples_on_device(req: Request) -> bool:
    """Whether the device sampler can draw this request's next token exactly as sampler.py would
    (up to the random stream of an unseeded draw)."""
    p = req.params
    return (
        req.generator is None
        and not p.has_penalties
        and not p.logit_bias
        and not p.masks_tokens
        and p.min_p == 0.0
        and len(req.output_token_ids) >= p.min_tokens
        and p.logprobs is None
        and not p.use_beam_search
        and p.pooling is None
        # n > 1 before its first token: siblings draw theirs from its logits row, and under
        # pipeline parallelism more may join while this step is in flight (sample_groups.py)
        and not (req.group_id is not None and not req.output_token_ids)
        and not fault_injected(req)  # the test hook raises in the host sampler: keep it there
    )


class DeviceSamplingPlanner:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size  # the bitmask's width, as the grammars were compiled for

    def plan(self, sched: SchedulerOutput) -> DeviceSampling | None:
        """The step's requests that produce a token, need no host state and are not verifying
        drafts; None when there are none."""
        reqs = [
            req
            for req, n in sched.scheduled
            if req.num_computed_tokens + n == req.num_tokens and samples_on_device(req)
        ]
        if not reqs:
            return None
        grammar_rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        constrained = [reqs[i] for i in grammar_rows]
        bitmask = fill_grammar_bitmask(constrained, self.vocab_size) if constrained else b""
        return DeviceSampling(
            [r.request_id for r in reqs],
            [0.0 if r.params.greedy else r.params.temperature for r in reqs],
            [r.params.top_k for r in reqs],
            [r.params.top_p for r in reqs],
            grammar_rows,
            bitmask,
        )
