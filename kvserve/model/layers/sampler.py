"""Batched sampling over one step's logits: penalties, temperature, top-k/p, min-p, seeds.

All rows are processed with tensor ops; the only per-row Python work is drawing noise for
requests that carry their own seed (so their samples do not depend on what else is in the
batch). Sampling uses the exponential-race trick: argmax(p / E) with E ~ Exp(1) draws from p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.request import Request


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


def _pad(rows: list[list[int]], fill: int) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) or 1
    return torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=torch.long)


def apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> None:
    """Repetition (prompt + output, HF semantics), presence and frequency (output, OpenAI)."""
    vocab = logits.shape[1]
    rows = [i for i, r in enumerate(reqs) if r.params.has_penalties]
    if not rows:
        return
    idx = torch.tensor(rows)
    sub = logits[idx]
    out_ids = _pad([reqs[i].output_token_ids for i in rows], vocab)
    counts = torch.zeros(len(rows), vocab + 1).scatter_add_(1, out_ids, torch.ones(out_ids.shape))[:, :vocab]
    rep = torch.tensor([reqs[i].params.repetition_penalty for i in rows]).unsqueeze(1)
    if (rep != 1.0).any():
        seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool)
        seen.scatter_(1, _pad([reqs[i].prompt_token_ids for i in rows], vocab), True)
        seen = seen[:, :vocab] | (counts > 0)
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
    freq = torch.tensor([reqs[i].params.frequency_penalty for i in rows]).unsqueeze(1)
    pres = torch.tensor([reqs[i].params.presence_penalty for i in rows]).unsqueeze(1)
    sub = sub - freq * counts - pres * (counts > 0).float()
    logits[idx] = sub


def _mask_top_k_top_p_min_p(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    top_k = [r.params.top_k for r in reqs]
    top_p = [r.params.top_p for r in reqs]
    min_p = [r.params.min_p for r in reqs]
    if any(min_p):
        probs = logits.softmax(-1)
        thresh = torch.tensor(min_p).unsqueeze(1) * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    if not any(top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, order = logits.sort(-1, descending=True)
    vocab = logits.shape[1]
    k = torch.tensor([t if t > 0 else vocab for t in top_k]).unsqueeze(1)
    ranks = torch.arange(vocab).unsqueeze(0)
    drop = ranks >= k
    p = torch.tensor(top_p).unsqueeze(1)
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    drop |= sorted_probs.cumsum(-1) - sorted_probs >= p  # mass before a token; keeps the one crossing p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SampleResult:
        """logits: float32 [len(reqs), vocab] on CPU."""
        want_logprobs = [r.params.logprobs for r in reqs]
        raw_logprobs = logits.log_softmax(-1) if any(x is not None for x in want_logprobs) else None

        if any(r.params.logit_bias for r in reqs):
            for i, r in enumerate(reqs):
                for tok, bias in (r.params.logit_bias or {}).items():
                    logits[i, tok] += bias
        apply_penalties(logits, reqs)
        for i, r in enumerate(reqs):
            if len(r.output_token_ids) < r.params.min_tokens:
                banned = list(r.eos_token_ids | r.stop_token_ids)
                if banned:
                    logits[i, banned] = float("-inf")

        greedy = [r.params.greedy for r in reqs]
        tokens = logits.argmax(-1)
        if not all(greedy):
            temps = torch.tensor([1.0 if g else r.params.temperature for g, r in zip(greedy, reqs)])
            scaled = _mask_top_k_top_p_min_p(logits / temps.unsqueeze(1), reqs)
            probs = scaled.softmax(-1)
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
            for i, r in enumerate(reqs):
                if r.generator is not None and not greedy[i]:
                    noise[i].exponential_(generator=r.generator)
            sampled = (probs / noise).argmax(-1)
            tokens = torch.where(torch.tensor(greedy), tokens, sampled)

        token_list = tokens.tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(reqs)
        if raw_logprobs is not None:
            for i, k in enumerate(want_logprobs):
                if k is None:
                    continue
                entry = {token_list[i]: raw_logprobs[i, token_list[i]].item()}
                if k > 0:
                    vals, ids = raw_logprobs[i].topk(k)
                    for t, v in zip(ids.tolist(), vals.tolist()):
                        entry.setdefault(t, v)
                logprobs[i] = entry
        return SampleResult(token_list, logprobs)
