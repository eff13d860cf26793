"""Shared helpers for benchmark scripts: workload prompts, the run's header line and the
transformers reference."""

from __future__ import annotations

import datetime
import os
import platform
import random
import time

import torch

_WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line "
    "end member law car city community name president team minute idea kid body information back "
    "parent face others level office door health person art war history party result change "
    "morning reason research girl guy moment air teacher force education"
).split()


def make_prompts(tokenizer, num: int, length: int, seed: int = 0, jitter: int = 8) -> list[list[int]]:
    """`num` distinct prompts of length±jitter real tokens, made of English words."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        target = length + rng.randint(-jitter, jitter)
        text = " ".join(rng.choice(_WORDS) for _ in range(target * 2))
        prompts.append(tokenizer.encode(text, add_special_tokens=False)[:target])
    return prompts


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def run_header() -> str:
    """The line every benchmark run starts with: this machine, its CPU flags, the time (UTC) and
    the load average, so a figure can be read beside the host it came from."""
    from benchmarks.cpu_info import cpu_flags

    when = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
    return f"{machine()}; CPU flags: {cpu_flags()}; {when}; load average {os.getloadavg()}"


def load_hf_reference(gguf_path: str):
    """The default model in transformers (dequantized from the same GGUF), fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    d, f = gguf_path.rsplit("/", 1)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def hf_generate_one_at_a_time(model, prompts: list[list[int]], max_new_tokens: int) -> tuple[int, float]:
    """Each request alone through `generate` (greedy, fixed length). Returns (tokens, seconds)."""
    t0 = time.perf_counter()
    total = 0
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
        )  # fmt: skip
        total += out.shape[1] - ids.shape[1]
    return total, time.perf_counter() - t0


@torch.inference_mode()
def hf_generate_static_batches(
    model, prompts: list[list[int]], max_new_tokens: int, batch_size: int
) -> tuple[int, float]:
    """Static padded batches (left padding) through `generate`. Returns (tokens, seconds)."""
    t0 = time.perf_counter()
    total = 0
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
        total += (out.shape[1] - width) * len(batch)
    return total, time.perf_counter() - t0


def _best_us(fn, reps: int, clock) -> float:
    """Best of `reps` timed calls of fn by `clock`, in microseconds."""
    best = float("inf")
    for _ in range(reps):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best * 1e6


def cpu_us(fn, reps: int = 20) -> float:
    """Microseconds of this thread's CPU time per call of `fn`, the best of `reps` calls.

    Kernel tables use CPU time with one torch thread (the caller sets it): on a shared
    2-core machine wall time mostly measures when the scheduler gave the core back, while a
    thread's CPU time counts only the work (memory stalls included). Calls over 50 ms run
    twice."""
    fn()
    t0 = time.thread_time()
    fn()
    if time.thread_time() - t0 > 0.05:
        reps = 2
    return _best_us(fn, reps, time.thread_time)


def wall_us(fn, reps: int) -> float:
    """Best wall-clock microseconds of `reps` calls of fn (after one warm-up call), with the
    engine's threads: for the figures a user sees, where cpu_us would count one thread."""
    fn()
    return _best_us(fn, reps, time.perf_counter)
