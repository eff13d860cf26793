"""Perplexity through the engine's prompt logprobs, so it measures what serving computes.

The corpus is cut into non-overlapping windows of `window` tokens; each window is one
request asking for prompt logprobs (and one throw-away output token). Every token of a
window but its first is scored given the tokens before it in that window, and all windows
run together under continuous batching. perplexity = exp(mean negative log-likelihood).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

from tqdm import tqdm

from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams

CORPUS = os.path.join(os.path.dirname(__file__), "data", "persuasion_ch1-8.txt")


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    num_tokens: int  # tokens scored
    num_windows: int
    seconds: float
    window: int = 0  # tokens per window as run (the one asked for, cut to what the engine holds)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0


def load_corpus(engine: LLMEngine, path: str = CORPUS, max_tokens: int | None = None) -> list[int]:
    """The corpus as token ids (no special tokens), cut to `max_tokens` if given. ValueError
    naming the file when it holds fewer than the 2 tokens a score needs (the first token of a
    window is only context): a one-character file passes the CLI's check for text."""
    with open(path, encoding="utf-8-sig") as f:  # a byte-order mark is no text to score
        ids = engine.tokenizer.encode(f.read(), add_special_tokens=False)
    if len(ids) < 2:
        raise ValueError(
            f"corpus: {path!r} is {len(ids)} token{'s' * (len(ids) != 1)} for this model's tokenizer; "
            "perplexity needs at least 2 (each is scored given the ones before it): give a longer text"
        )
    return ids[:max_tokens] if max_tokens else ids


def perplexity(
    engine: LLMEngine, token_ids: list[int], window: int = 1024, progress: bool = True
) -> PerplexityResult:
    """Score `token_ids` in windows of `window` tokens (clamped to what the engine can hold)."""
    window = min(window, engine.max_model_len - 1)
    if window < 2:
        raise ValueError(f"window: must be >= 2, got {window}")
    windows = [token_ids[i : i + window] for i in range(0, len(token_ids), window)]
    windows = [w for w in windows if len(w) >= 2]
    if not windows:
        raise ValueError("token_ids: need at least 2 tokens to score")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    t0 = time.perf_counter()
    for i, w in enumerate(windows):
        engine.add_request(f"ppl-{i}", w, params)
    total_nll, scored = 0.0, 0
    bar = tqdm(total=sum(len(w) - 1 for w in windows), unit="tok", disable=not progress, desc="perplexity")
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.finished:
                continue
            idx = int(out.request_id.split("-")[1])
            w = windows[idx]
            for j in range(1, len(w)):
                total_nll -= out.prompt_logprobs[j][w[j]]
            scored += len(w) - 1
            bar.update(len(w) - 1)
    bar.close()
    seconds = time.perf_counter() - t0
    nll = total_nll / scored
    return PerplexityResult(math.exp(nll), nll, scored, len(windows), seconds, window)
