"""Batched sampling over one step's logits: penalties, temperature, top-k/p, min-p, seeds,
and verification of speculative tokens.

All rows are processed with tensor ops; the only per-row Python work is drawing noise for
requests that carry their own seed (so their samples do not depend on what else is in the
batch). Sampling uses the exponential-race trick: argmax(p / E) with E ~ Exp(1) draws from p.

A row is anything shaped like a Request (params, prompt/output token ids, eos/stop ids,
generator). Verification scores a speculative request at each of its k + 1 positions through
`Lookahead` rows, which see the proposed tokens as already generated, so penalties and
min_tokens apply to p exactly as they would have without speculation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvserve.model.layers.bad_words import banned_tokens
from kvserve.model.layers.cpu_kernels import loaded_cpu_kernels
from kvserve.model.layers.empty_rows import NO_TOKEN, empty_rows
from kvserve.request import Request


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    beam_logprobs: list[float] | None = None
    """Beam search: token_ids are the row's best candidates and these their log-probabilities
    (nothing is sampled; engine/beam_search.py chooses)."""
    ranks: list[int | None] | None = None
    """Per token, where its row asks for logprobs: its rank in the vocabulary (1 + the tokens
    with a higher logprob), as vLLM's `Logprob.rank`; the top-k entry alone cannot tell it
    for a token outside the top-k (always with logprobs=0)."""


class Lookahead:
    """A request seen `extra` tokens further on: the row for one speculative position."""

    def __init__(self, req: Request, extra: list[int]) -> None:
        self.req = req
        self.params = req.params
        self.prompt_token_ids = req.prompt_token_ids
        self.output_token_ids = req.output_token_ids + extra if extra else req.output_token_ids
        self.eos_token_ids = req.eos_token_ids
        self.stop_token_ids = req.stop_token_ids
        self.generator = req.generator


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest value, the first one on ties (as `argmax`). Greedy decoding
    takes one per token: on the CPU, float32 rows go to kvserve's C++ kernel (csrc/
    sampling_cpu.cpp) where the process has loaded it (a CPU model has), else `torch.max(dim)`,
    ~3x faster than `argmax` for vocabulary-wide rows (benchmarks/bench_row_argmax.py)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1]:
        kernels = loaded_cpu_kernels()
        if kernels is not None:
            return kernels.row_argmax(x.contiguous())
    return torch.max(x, -1).indices


def _pad(rows: list[list[int]], fill: int) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) or 1
    return torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=torch.long)


def apply_penalties(logits: torch.Tensor, reqs: list) -> None:
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


def _mask_top_k_top_p_min_p(logits: torch.Tensor, reqs: list) -> torch.Tensor:
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


MIN_LOGPROB = -9999.0  # what a token a grammar forbids (-inf) reports: JSON has no infinity (as vLLM)


def _mask_tokens(logits: torch.Tensor, row: int, req) -> None:
    """vLLM's allowed_token_ids (all others -inf) and bad_words (bad_words.py) on one row."""
    p = req.params
    if p.allowed_token_ids is not None:
        keep = torch.tensor(p.allowed_token_ids, dtype=torch.long, device=logits.device)
        kept = logits[row, keep].clone()
        logits[row] = float("-inf")
        logits[row, keep] = kept
    if p.bad_words_token_ids:
        banned = banned_tokens(p.bad_words_token_ids, req.output_token_ids)
        if banned:
            logits[row, banned] = float("-inf")


def _entry(raw_logprobs: torch.Tensor, row: int, token: int, k: int) -> dict[int, float]:
    """The chosen token's logprob plus the top-k, as the API reports them. Under a grammar
    fewer than k tokens may be allowed; the rest of the top-k are forbidden ones, at MIN_LOGPROB."""
    entry = {token: max(raw_logprobs[row, token].item(), MIN_LOGPROB)}
    if k > 0:
        vals, ids = raw_logprobs[row].topk(k)
        for t, v in zip(ids.tolist(), vals.tolist()):
            entry.setdefault(t, max(v, MIN_LOGPROB))
    return entry


def _rank(raw_logprobs: torch.Tensor, row: int, token: int) -> int:
    """1 + how many tokens of the row have a higher logprob than `token` (vLLM's rank): one
    comparison pass over a row that asks for logprobs, which its top-k already pays for."""
    values = raw_logprobs[row]
    return int((values > values[token]).sum()) + 1


FAULT_INJECTION_ENV = "KVSERVE_FAULT_INJECT_SAMPLING"


def _marked(req, mark: str | None) -> bool:
    return bool(mark) and mark in getattr(req, "request_id", "")


def fault_injected(req) -> bool:
    """Whether the test hook below makes this request's sampling raise."""
    return _marked(req, os.environ.get(FAULT_INJECTION_ENV))


def _maybe_inject_fault(reqs: list) -> None:
    """Test hook: raise when a row's request id contains $KVSERVE_FAULT_INJECT_SAMPLING, so
    tests can prove one failing request does not take the batch down with it."""
    mark = os.environ.get(FAULT_INJECTION_ENV)  # once a step, not once a row
    if mark and any(_marked(r, mark) for r in reqs):
        raise RuntimeError(f"fault injected into sampling (request id contains {mark!r})")


def argmax_only(req) -> bool:
    """Whether a row's token is its raw logits' argmax and nothing more is asked: greedy, no
    logprobs, and nothing that edits the logits first (bias, allowed tokens, bad words,
    penalties, min_tokens in force)."""
    p = req.params
    return (
        p.greedy
        and p.logprobs is None
        and not p.logit_bias
        and not p.masks_tokens
        and not p.has_penalties
        and len(req.output_token_ids) >= p.min_tokens
    )


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def _prepare(self, logits: torch.Tensor, reqs: list) -> torch.Tensor | None:
        """Apply logit bias, allowed_token_ids, bad_words, penalties and min_tokens in place;
        returns the raw logprobs (before any of that, as vLLM's) when a row asks for logprobs."""
        want = any(r.params.logprobs is not None for r in reqs)
        raw_logprobs = logits.log_softmax(-1) if want else None
        if any(r.params.logit_bias for r in reqs):
            for i, r in enumerate(reqs):
                for tok, bias in (r.params.logit_bias or {}).items():
                    logits[i, tok] += bias
        for i, r in enumerate(reqs):
            if r.params.masks_tokens:
                _mask_tokens(logits, i, r)
        apply_penalties(logits, reqs)
        for i, r in enumerate(reqs):
            if len(r.output_token_ids) < r.params.min_tokens:
                banned = list(r.eos_token_ids | r.stop_token_ids)
                if banned:
                    kept = logits[i, banned].clone()
                    logits[i, banned] = float("-inf")
                    # A grammar that is complete allows only its end: it outranks min_tokens
                    # (a row with nothing left would draw a token the grammar refuses).
                    if torch.isneginf(logits[i]).all():
                        logits[i, banned] = kept
        return raw_logprobs

    @staticmethod
    def _probs(logits: torch.Tensor, reqs: list) -> torch.Tensor:
        """The distribution each row samples from (temperature, top-k, top-p, min-p applied)."""
        temps = torch.tensor([1.0 if r.params.greedy else r.params.temperature for r in reqs])
        return _mask_top_k_top_p_min_p(logits / temps.unsqueeze(1), reqs).softmax(-1)

    def _race(self, probs: torch.Tensor, reqs: list) -> torch.Tensor:
        """One draw per row from probs (exponential race), seeded rows use their own generator."""
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, r in enumerate(reqs):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        return row_argmax(probs / noise)

    def __call__(self, logits: torch.Tensor, reqs: list) -> SampleResult:
        """logits: float32 [len(reqs), vocab] on CPU."""
        _maybe_inject_fault(reqs)
        if all(argmax_only(r) for r in reqs):  # the common greedy step: one kernel call, no passes
            return SampleResult(row_argmax(logits).tolist(), [None] * len(reqs))
        raw_logprobs = self._prepare(logits, reqs)
        empty = empty_rows(logits, reqs)
        greedy = [r.params.greedy for r in reqs]
        tokens = row_argmax(logits)
        if not all(greedy):
            sampled = self._race(self._probs(logits, reqs), reqs)
            tokens = torch.where(torch.tensor(greedy), tokens, sampled)
        token_list = tokens.tolist()
        for i in empty:
            token_list[i] = NO_TOKEN
        logprobs: list[dict[int, float] | None] = [None] * len(reqs)
        ranks: list[int | None] = [None] * len(reqs)
        for i, r in enumerate(reqs):
            if r.params.logprobs is not None and token_list[i] != NO_TOKEN:
                logprobs[i] = _entry(raw_logprobs, i, token_list[i], r.params.logprobs)
                ranks[i] = _rank(raw_logprobs, i, token_list[i])
        return SampleResult(token_list, logprobs, ranks=ranks)

    def verify(self, logits: torch.Tensor, req: Request, drafts: list[int]) -> SampleResult:
        """Score k proposed tokens with the target's k + 1 rows of logits; returns the tokens
        to emit: the accepted prefix of `drafts` plus one token from the target.

        Greedy: accept while a draft equals the target's argmax. Sampling: draw position i's
        token from p_i exactly as a step without speculation would (one race, the same noise
        from the same generator), emit it, and go on to position i + 1 only if it equals the
        draft. The proposers here are deterministic (q is one-hot on the draft), for which this
        is the rejection sampler: draft i survives with probability p_i(d), and a rejected
        position's token follows p_i without d. Drawing per position, and only for positions
        reached, keeps a seeded request's tokens those of the same request without
        speculation, whatever was proposed (which depends on the batch and on preemption).
        """
        k = len(drafts)
        rows = [Lookahead(req, drafts[:i]) for i in range(k + 1)]
        raw_logprobs = self._prepare(logits, rows)
        empty = set(empty_rows(logits, rows))  # a position with nothing to sample ends the tokens
        if req.params.greedy:
            targets = row_argmax(logits).tolist()
            n = 0
            while n < k and n not in empty and drafts[n] == targets[n]:
                n += 1
            tokens = drafts[:n] + [NO_TOKEN if n in empty else targets[n]]
        else:
            probs = self._probs(logits, rows)
            tokens = []
            for i in range(k + 1):
                if i in empty:
                    tokens.append(NO_TOKEN)
                    break
                tokens.append(int(self._race(probs[i : i + 1], rows[i : i + 1])[0]))
                if i == k or tokens[i] != drafts[i]:
                    break
        logprobs: list[dict[int, float] | None] = [None] * len(tokens)
        ranks: list[int | None] = [None] * len(tokens)
        if req.params.logprobs is not None:
            live = [(i, t) for i, t in enumerate(tokens) if t != NO_TOKEN]
            logprobs[: len(live)] = [_entry(raw_logprobs, i, t, req.params.logprobs) for i, t in live]
            ranks[: len(live)] = [_rank(raw_logprobs, i, t) for i, t in live]
        return SampleResult(tokens, logprobs, ranks=ranks)
