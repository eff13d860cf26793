"""Step-time calibration of the autoscaling simulator's replica model (kvserve/planner/simulate.py),
from the offline engine, not from any server run it is later compared with.

A step costs overhead + decode_token_s x decoding sequences + prefill_token_s x prompt tokens.
Decode steps are timed at several batch sizes (short prompts, all sequences decoding; the
slope is the cost of one more sequence in the batch, the intercept the fixed cost of a step),
prefill steps at several prompt lengths (one prompt alone; the slope is the cost of a prompt
token). The two slopes differ on a CPU: a decode token is one row through every weight plus
its attention over the context, a prefill token one row of a large matmul. Each point is the
median of its steps after two untimed ones (oneDNN builds a kernel per new shape).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from benchmarks.common import make_prompts


@dataclass
class Calibration:
    overhead_s: float
    decode_token_s: float
    prefill_token_s: float
    prefill_overhead_s: float
    decode_points: list[tuple[int, float]]  # (batch, median step s)
    prefill_points: list[tuple[int, float]]  # (prompt tokens, median step s)


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def _decode_step(llm, batch: int, context: int, steps: int, seed: int) -> float:
    from kvserve import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i, p in enumerate(make_prompts(llm.tokenizer, batch, context, seed=seed, jitter=0)):
        engine.add_request(f"d{seed}-{i}", p, params)
    times, decoding = [], False
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if decoding:
            times.append(dt)
        # every sequence has its first token: the following steps are pure decode
        decoding = decoding or (len(outs) == batch and all(o.outputs[0].token_ids for o in outs))
    return statistics.median(times[2:steps])


def _prefill_step(llm, length: int, reps: int, seed: int) -> float:
    from kvserve import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for r, p in enumerate(make_prompts(llm.tokenizer, reps + 2, length, seed=seed, jitter=0)):
        engine.add_request(f"p{seed}-{r}", p, params)  # a new prompt each time: no cache hit
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def calibrate(
    model: str,
    kv_cache_memory: str,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    context: int,
    batches: list[int],
    lengths: list[int],
) -> Calibration:
    """`context`: the decode sequences' prompt length (the trace's median prompt), so their
    attention reads about as much KV as the trace's requests do."""
    from kvserve import LLM

    llm = LLM(model, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_num_batched_tokens)  # fmt: skip
    try:
        dec = [(b, _decode_step(llm, b, context, 24, seed=10 + b)) for b in batches if b <= max_num_seqs]
        pre = [(n, _prefill_step(llm, n, 5, seed=1000 + n)) for n in lengths if n <= max_num_batched_tokens]
    finally:
        llm.llm_engine.core.shutdown()  # its memory and threads are gone before the server starts
    d0, d1 = _fit(dec)
    p0, p1 = _fit(pre)
    return Calibration(d0, d1, p1, p0, dec, pre)
