"""n > 1 sampling from one prefill (engine/sample_groups.py): the siblings fork from the first
request once its prompt is computed, sharing its blocks copy-on-write."""

from __future__ import annotations

from kvserve import LLM, SamplingParams


def _run_core(engine) -> int:
    """Step the core until idle; the tokens it computed."""
    total = 0
    while engine.core.has_unfinished_requests():
        total += engine.core.step().iteration_tokens
    return total


def test_n_samples_compute_the_prompt_once(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_memory="64MiB", enable_prefix_caching=False, max_model_len=512)
    engine = llm.llm_engine
    prompt = [1] + [(11 * i) % 500 + 3 for i in range(499)]
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=1)
    for j in range(8):
        engine.core.add_request(engine.processor.process(f"s{j}", prompt, params, group_id="g"))
    # 500 prompt tokens once, then 7 decode steps of 8 samples (the first tokens come from the
    # prefill's logits row); without forking each sibling also recomputed the 4-token tail.
    assert _run_core(engine) == 500 + 8 * 7
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_forked_samples_equal_the_same_seeds_alone(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_memory="4MiB")
    prompt = [1, 5, 9, 33, 70, 100, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    p = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    out = llm.generate([prompt], p, use_tqdm=False)[0].outputs
    for j, c in enumerate(out):
        alone = SamplingParams(temperature=1.0, seed=7 + j, max_tokens=10, ignore_eos=True)
        assert c.token_ids == llm.generate([prompt], alone, use_tqdm=False)[0].outputs[0].token_ids


def test_aborted_leader_hands_the_prompt_to_a_sibling(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_memory="4MiB")
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for j in range(3):
        engine.add_request(f"a{j}", [1, 2, 3, 4, 5, 6], params, group_id="grp")
    engine.abort_request("a0", report=False)  # the leader, before its prompt ran
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
    assert set(finals) == {"a1", "a2"} and finals["a1"] == finals["a2"] and len(finals["a1"]) == 6
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_group_waits_for_seats_for_all_its_samples(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_memory="4MiB", max_num_seqs=4)
    engine = llm.llm_engine
    engine.add_request("solo", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for j in range(4):
        engine.add_request(
            f"g{j}", [1, 7, 8], SamplingParams(temperature=1.0, max_tokens=3, seed=j), group_id="g"
        )
    while engine.has_unfinished_requests():
        engine.step()
        assert len(engine.scheduler.running) <= 4
