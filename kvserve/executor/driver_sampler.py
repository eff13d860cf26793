"""Sampling in the engine process, from the logits rank 0 returns.

The state sampling needs lives with the scheduler's `Request`s: grammar matchers (structured
outputs mask each row, and advance over drafts to mask verification rows), per-request seeded
generators, the output history penalties read. Sampling here, once, keeps every rank free of
that state; the price is moving rows x vocab float32 logits from rank 0 each step (measured in
benchmarks/bench_parallel.py). With one rank no bytes move at all.
"""

from __future__ import annotations

import torch

from kvserve.model.layers.sampler import Sampler, SampleResult
from kvserve.request import Request
from kvserve.structured.bitmask import apply_grammar_bitmask, apply_grammar_bitmask_to_drafts
from kvserve.worker.step_input import RunnerOutput


class DriverSampler:
    def __init__(self, seed: int) -> None:
        self.sampler = Sampler(seed)

    @torch.inference_mode()
    def sample(self, out: RunnerOutput, requests: dict[str, Request]) -> dict[str, SampleResult]:
        """Tokens to emit per request id: one, or an accepted speculative run plus one."""
        results: dict[str, SampleResult] = {}
        if out.logits is None:
            return results
        logits = out.logits
        sample_reqs = [requests[rid] for rid in out.sample_req_ids]
        if sample_reqs:
            n = len(sample_reqs)
            apply_grammar_bitmask(logits[:n], sample_reqs)  # [structured outputs] constrained rows only
            sampled = self.sampler(logits[:n], sample_reqs)
            for i, req in enumerate(sample_reqs):
                results[req.request_id] = SampleResult([sampled.token_ids[i]], [sampled.logprobs[i]])
        row = len(sample_reqs)
        for rid, k in out.verify:
            req = requests[rid]
            drafts = req.spec_token_ids[:k]
            end = row + k + 1
            if req.grammar is not None:  # [structured outputs] each row masked after its drafts
                apply_grammar_bitmask_to_drafts(logits[row:end], req, drafts)
            results[rid] = self.sampler.verify(logits[row:end], req, drafts)
            row = end
        return results
