"""Batches are padded to a bounded set of row counts (worker/shape_buckets.py): every matmul the
engine issues has a bucket-sized input, and the padding never changes a token."""

from __future__ import annotations

import random

from conftest import load_reference
from helpers import assert_greedy_match, reference_greedy

import kvserve.model.layers.parallel_linear as parallel_linear
from kvserve import LLM, SamplingParams
from kvserve.worker.shape_buckets import all_buckets, padded_rows


def test_buckets_are_exact_when_small_and_at_most_an_eighth_padding():
    assert [padded_rows(n) for n in range(1, 17)] == list(range(1, 17))
    assert [padded_rows(n, min_rows=2) for n in range(4)] == [0, 2, 2, 3]
    for n in range(1, 5000):
        b = padded_rows(n)
        assert n <= b <= n * 1.125, n
        assert padded_rows(b) == b, n  # a bucket is its own bucket
    sizes = all_buckets(512)
    assert sizes == sorted(set(sizes)) and sizes[-1] == 512
    assert len(sizes) == 16 + 8 * 5  # 1..16, then eight per doubling up to 512
    assert all_buckets(500)[-1] == 512  # the bucket of the step budget itself


def test_every_matmul_runs_on_a_bucket_and_tokens_match_the_reference(tiny_llama_dir, monkeypatch):
    seen: set[int] = set()
    real = parallel_linear.linear

    def recording(x, weight, bias, packed):
        seen.add(x.shape[0])
        return real(x, weight, bias, packed)

    monkeypatch.setattr(parallel_linear, "linear", recording)
    llm = LLM(tiny_llama_dir, kv_cache_memory="64MiB", max_num_batched_tokens=96)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(1, 70))] for _ in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 9), ignore_eos=True) for _ in prompts]
    outs = llm.generate(prompts, params, use_tqdm=False)

    buckets = set(all_buckets(96))
    assert seen and seen <= buckets, sorted(seen - buckets)
    assert any(n not in range(1, 17) for n in seen)  # prefills were padded, not only decodes
    ref = load_reference(tiny_llama_dir)
    for p, sp, o in zip(prompts, params, outs):
        expected = reference_greedy(ref, p, sp.max_tokens, None)
        assert_greedy_match(ref, p, expected, o.outputs[0].token_ids, f"prompt of {len(p)}")
