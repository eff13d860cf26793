"""Sampling in the engine process, from the logits rank 0 returns.

The state sampling needs lives with the scheduler's `Request`s: grammar matchers (structured
outputs mask each row, and advance over drafts to mask verification rows), per-request seeded
generators, the output history penalties read. Sampling here, once, keeps every rank free of
that state; the price is moving rows x vocab float32 logits from rank 0 each step (measured in
benchmarks/bench_parallel.py). With one rank no bytes move at all. Rows that need none of that
state can be sampled on the device instead (on CUDA: executor/device_sampling.py); they arrive
as token ids in `RunnerOutput.sampled`.

Beam-search rows are not sampled: each gets its best candidates by log-probability (as
transformers scores beams: log_softmax of the raw logits), and the beam group chooses.
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
        # rows sampled on the device (executor/device_sampling.py): their token is all there is
        results = {rid: SampleResult([token], [None]) for rid, token in out.sampled.items()}
        if out.logits is None:
            return results
        logits = out.logits
        all_reqs = [requests[rid] for rid in out.sample_req_ids]
        rows = [i for i, r in enumerate(all_reqs) if not r.params.use_beam_search]
        sample_reqs = [all_reqs[i] for i in rows]
        # n > 1 (engine/sample_groups.py): siblings draw their first token from their leader's
        # row, each with its own seed; taken before the leader's sampling touches the row.
        followers = [(r.followers, logits[i].expand(len(r.followers), -1).clone())
                     for i, r in enumerate(all_reqs) if r.followers]  # fmt: skip
        if sample_reqs:
            n = len(sample_reqs)
            rows_logits = logits[: len(all_reqs)] if n == len(all_reqs) else logits[rows]
            apply_grammar_bitmask(rows_logits, sample_reqs)  # [structured outputs] constrained rows only
            sampled = self.sampler(rows_logits, sample_reqs)
            for i, req in enumerate(sample_reqs):
                results[req.request_id] = _one_row(sampled, i)
        for reqs, rows_logits in followers:
            sampled = self.sampler(rows_logits, reqs)
            for i, req in enumerate(reqs):
                results[req.request_id] = _one_row(sampled, i)
        for i, req in enumerate(all_reqs):
            if req.params.use_beam_search:
                results[req.request_id] = beam_candidates(logits[i], req)
        row = len(all_reqs)
        for rid, k in out.verify:
            req = requests[rid]
            drafts = req.spec_token_ids[:k]
            end = row + k + 1
            if req.grammar is not None:  # [structured outputs] each row masked after its drafts
                apply_grammar_bitmask_to_drafts(logits[row:end], req, drafts)
            results[rid] = self.sampler.verify(logits[row:end], req, drafts)
            row = end
        return results


def _one_row(sampled: SampleResult, i: int) -> SampleResult:
    """Row i of a batch's SampleResult, as the request's own."""
    ranks = [sampled.ranks[i]] if sampled.ranks is not None else None
    return SampleResult([sampled.token_ids[i]], [sampled.logprobs[i]], ranks=ranks)


def beam_candidates(row: torch.Tensor, req: Request) -> SampleResult:
    """A beam's best next tokens: as many as a beam step can use, (1 + stop tokens) x width
    and at least 2 x width (transformers' `beams_to_keep`); below min_tokens the stop tokens
    are out (log-probability -inf, as its MinNewTokensLengthLogitsProcessor)."""
    stops = req.eos_token_ids | req.stop_token_ids
    lp = torch.log_softmax(row.float(), dim=-1)
    if stops and len(req.output_token_ids) < req.params.min_tokens:
        lp[list(stops)] = float("-inf")
    keep = min(max(2, 1 + len(stops)) * req.params.n, lp.numel())
    top = lp.topk(keep)
    return SampleResult(top.indices.tolist(), [], top.values.tolist())
