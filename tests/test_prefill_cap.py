"""long_prefill_token_threshold: while requests decode, a step takes at most that many prefill
tokens (long prompts arrive a chunk per step), and greedy results do not change."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig

CAP = 8


def _run(path: str, cap: int) -> tuple[dict[str, list[int]], list]:
    """Two short requests decode; two long prompts arrive while they do."""
    llm = LLM(path, kv_cache_memory="8MiB", max_num_batched_tokens=64, long_prefill_token_threshold=cap)
    engine = llm.llm_engine
    steps: list = []
    original = engine.scheduler.schedule

    def schedule():
        out = original()
        steps.append([(r.num_computed_tokens, r.num_tokens, n) for r, n in out.scheduled])
        return out

    engine.scheduler.schedule = schedule
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"short{i}", [1, 10 + i, 20, 30], params)
    arrivals = {3: ("long0", list(range(5, 105))), 6: ("long1", list(range(200, 290)))}
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests() or arrivals:
        if step in arrivals:
            rid, prompt = arrivals.pop(step)
            engine.add_request(rid, [1] + prompt, params)
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        step += 1
    return tokens, steps


def test_prefill_capped_while_decoding_and_greedy_unchanged(tiny_llama_dir):
    capped, steps = _run(tiny_llama_dir, CAP)
    plain, plain_steps = _run(tiny_llama_dir, 0)
    assert capped == plain and len(capped) == 4
    saw_cap = False
    for step in steps:
        decoding = any(n == 1 and done == total - 1 for done, total, n in step)
        prefill = sum(n for done, total, n in step if n > 1)
        if decoding:
            assert prefill <= CAP, step
            saw_cap = saw_cap or prefill == CAP
    assert saw_cap
    # Without the cap a long prompt's first chunk took the rest of the 64-token budget.
    assert max(sum(n for _, _, n in s if n > 1) for s in plain_steps) > CAP


def test_no_decodes_no_cap(tiny_llama_dir):
    """A prompt arriving alone is not slowed down: the cap applies only while others decode."""
    llm = LLM(
        tiny_llama_dir, kv_cache_memory="8MiB", max_num_batched_tokens=64, long_prefill_token_threshold=CAP
    )
    engine = llm.llm_engine
    engine.add_request("a", list(range(1, 101)), SamplingParams(temperature=0, max_tokens=2))
    out = engine.scheduler.schedule()
    assert [n for _, n in out.scheduled] == [64]


def test_threshold_validated():
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        EngineConfig(long_prefill_token_threshold=-1)
