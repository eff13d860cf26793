"""A request that makes a step raise fails alone: the rest of its batch completes with the
tokens it would have produced without it, and every KV block comes back."""

from __future__ import annotations

import pytest

from kvserve import SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.model.layers.sampler import FAULT_INJECTION_ENV

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Continuous batching schedules every step.",
    "Hello world! 0123456789",
    "héllo wörld — naïve café",
    "The quick brown fox jumps over the lazy dog. Continuous batching",  # shares a prefix block
    "日本語 🙂 and some more text",
]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_llama_dir, kv_cache_memory="8MiB", max_model_len=256))


def run(engine: LLMEngine, requests: dict[str, str]) -> dict:
    for rid, prompt in requests.items():
        engine.add_request(rid, prompt, GREEDY)
    final = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0]
    assert not engine.has_unfinished_requests()
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    return final


def test_failing_request_fails_alone(engine, monkeypatch):
    reference = run(engine, {f"ref{i}": p for i, p in enumerate(PROMPTS)})
    engine.reset_prefix_cache()
    monkeypatch.setenv(FAULT_INJECTION_ENV, "poison")
    # The poisoned request is admitted in the same step as the others and shares its prompt's
    # first block with one of them (a same-step prefix-cache hit).
    batch = {f"ok{i}": p for i, p in enumerate(PROMPTS)}
    batch = {"poison": PROMPTS[0] + " poisoned", **batch}
    final = run(engine, batch)
    assert final["poison"].finish_reason == "error"
    assert "fault injected" in str(final["poison"].stop_reason)
    for i in range(len(PROMPTS)):
        got, want = final[f"ok{i}"], reference[f"ref{i}"]
        assert got.finish_reason == "length"
        assert got.token_ids == want.token_ids, i


def test_poison_while_others_decode(engine, monkeypatch):
    """The failing request joins a batch that is already decoding."""
    reference = run(engine, {"ref": PROMPTS[1]})
    monkeypatch.setenv(FAULT_INJECTION_ENV, "poison")
    engine.add_request("ok", PROMPTS[1], GREEDY)
    engine.step()
    engine.step()
    final = run(engine, {"poison-late": PROMPTS[2]})
    assert final["poison-late"].finish_reason == "error"
    assert final["ok"].token_ids == reference["ref"].token_ids


def test_seeded_neighbours_draw_as_without_the_failure(engine, monkeypatch):
    """Finding the culprit runs each request of the failed step alone, sampling included; a
    seeded survivor's generator is put back after, so its tokens are the ones it gets alone
    (they differed: its generator had advanced in the probe)."""
    seeded = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=12, ignore_eos=True) for i in range(3)]

    def run_seeded(requests: dict[str, tuple[str, SamplingParams]]) -> dict:
        for rid, (prompt, params) in requests.items():
            engine.add_request(rid, prompt, params)
        final = {}
        while engine.has_unfinished_requests():
            final.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
        return final

    reference = run_seeded({f"alone{i}": (PROMPTS[i], p) for i, p in enumerate(seeded)})
    monkeypatch.setenv(FAULT_INJECTION_ENV, "poison")
    batch = {"poison-seeded": (PROMPTS[3], GREEDY)}
    batch.update({f"s{i}": (PROMPTS[i], p) for i, p in enumerate(seeded)})
    final = run_seeded(batch)
    assert final["poison-seeded"].finish_reason == "error"
    for i in range(len(seeded)):
        assert final[f"s{i}"].token_ids == reference[f"alone{i}"].token_ids, i
