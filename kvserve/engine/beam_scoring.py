"""Beam search's bookkeeping, with transformers' semantics (`GenerationMixin._beam_search`).

Pure arithmetic over scores: no requests, no KV. Each step takes every live beam's candidate
tokens, keeps the best `keep` continuations of all of them by cumulative log-probability,
moves those that end (a stop token, or max_tokens reached) and rank among the first `width`
into the finished hypotheses (score = cumulative logprob / generated_length ** length_penalty,
the length counting the new token; the `width` best are kept), and continues with the
`width` best that did not end. When to stop follows `early_stopping`:
- True: as soon as `width` hypotheses are finished;
- False: once the best running beam, scored at its current length, cannot beat the worst
  finished hypothesis (transformers' heuristic);
- "never": the same test, but with a positive length_penalty the running beam is scored
  as if it reached max_tokens (the canonical bound).
Generation also stops when every continuation ends. Sums are float32, as transformers'.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_NEG = -1.0e9  # transformers' "no score" value


@dataclass
class Hypothesis:
    """A finished sequence of generated tokens (the stop token included, if one ended it)."""

    token_ids: list[int]
    score: float
    finish_reason: str  # "stop" | "length"
    stop_token: int | None = None
    cum_logprob: float = 0.0  # the unpenalized sum of its tokens' logprobs


@dataclass
class Continuation:
    """One of the next step's beams: `parent`'s tokens + `token`, with its cumulative logprob."""

    parent: int  # index into the beams given to `step`
    token: int
    cum_logprob: float


@dataclass
class BeamSearchState:
    width: int
    max_tokens: int
    stop_token_ids: frozenset[int]
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most `width`
    improvable: bool = True  # transformers' is_early_stop_heuristic_unsatisfied (sticky)
    done: bool = False

    @property
    def keep(self) -> int:
        """Continuations considered per step (transformers' beams_to_keep)."""
        return max(2, 1 + len(self.stop_token_ids)) * self.width

    def step(
        self,
        beams: list[tuple[list[int], float, list[int], list[float]]],
        num_generated: int,
    ) -> list[Continuation]:
        """One step over (output tokens so far, cumulative logprob, candidate tokens, their
        logprobs) per live beam, all `num_generated` tokens long. Returns the continuing
        beams, best first; sets `done` when the search is over."""
        cums, lps, parents, tokens = [], [], [], []
        for b, (_, cum, cand_tokens, cand_lps) in enumerate(beams):
            cums += [cum] * len(cand_tokens)
            lps += cand_lps
            parents += [b] * len(cand_tokens)
            tokens += cand_tokens
        scores = torch.tensor(cums, dtype=torch.float32) + torch.tensor(lps, dtype=torch.float32)
        k = min(self.keep, scores.numel())
        top = scores.topk(k)
        new_len = num_generated + 1
        ranked = [(parents[i], tokens[i], s) for i, s in zip(top.indices.tolist(), top.values.tolist())]
        ends = [t in self.stop_token_ids or new_len >= self.max_tokens for _, t, _ in ranked]

        running = [Continuation(p, t, s) for (p, t, s), e in zip(ranked, ends) if not e][: self.width]

        full = len(self.finished) == self.width
        if self.improvable and not (full and self.early_stopping is True):
            new = []
            for rank, ((p, t, s), e) in enumerate(zip(ranked, ends)):
                if e and rank < self.width:
                    stopped = t in self.stop_token_ids
                    score = _penalized(s, new_len, self.length_penalty)
                    reason, stop_token = ("stop", t) if stopped else ("length", None)
                    new.append(Hypothesis(beams[p][0] + [t], score, reason, stop_token, s))
            if new:  # a stable sort: on a tie the older hypothesis stays ahead
                self.finished = sorted(self.finished + new, key=lambda h: -h.score)[: self.width]

        if len(self.finished) == self.width:
            if self.early_stopping == "never" and self.length_penalty > 0.0:
                best_len = self.max_tokens
            else:
                best_len = new_len
            best = running[0].cum_logprob if running else _NEG
            worst = self.finished[-1].score
            if not _penalized(best, best_len, self.length_penalty) > worst:
                self.improvable = False
        full = len(self.finished) == self.width
        self.done = not self.improvable or (full and self.early_stopping is True) or all(ends)
        return running


def _penalized(cum_logprob: float, length: int, length_penalty: float) -> float:
    """transformers' length-penalized score, in float32."""
    value = torch.tensor(cum_logprob, dtype=torch.float32) / (length**length_penalty)
    return value.item()
