"""Prefix caching, block sharing between the n samples of a request, and priority scheduling.

Model-free property tests drive the KV cache manager with a fake KV store (each slot holds the
token id written there), so a cache hit that would return another prefix's KV is caught.
"""

from __future__ import annotations

import pytest
from conftest import load_reference
from helpers import assert_greedy_match
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.request import Request

BS = 4
N_BLOCKS = 24


class FakeKV:
    """Manager + a KV store of token ids, checking every read against what was written."""

    def __init__(self, caching: bool = True) -> None:
        self.kv = KVCacheManager(N_BLOCKS, BS, enable_prefix_caching=caching)
        self.slots: dict[tuple[int, int], int] = {}
        self.live: dict[str, Request] = {}

    def schedule(self, req: Request, budget: int) -> bool:
        """Admit (with cache hits) or continue a request by up to `budget` tokens, then 'compute'."""
        hits = self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else []
        for i, b in enumerate(hits):  # a hit must hold exactly this request's tokens
            for o in range(BS):
                assert self.slots.get((b, o)) == req.all_token_ids[i * BS + o], "cache hit returned wrong KV"
        cached = len(hits) * BS
        n = min(req.num_tokens - req.num_computed_tokens - cached, budget)
        if not self.kv.allocate_slots(req, n, hits):
            return False
        req.num_computed_tokens += cached
        blocks = self.kv.get_block_ids(req.request_id)
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
            self.slots[(blocks[pos // BS], pos % BS)] = req.all_token_ids[pos]
        req.num_computed_tokens += n
        return True

    def check(self) -> None:
        kv, pool = self.kv, self.kv.pool
        held: dict[int, int] = {}
        for blocks in kv.req_to_blocks.values():
            assert len(blocks) == len(set(blocks))
            for b in blocks:
                held[b] = held.get(b, 0) + 1
        for b in range(N_BLOCKS):
            assert pool.ref_cnt[b] == held.get(b, 0), "reference count disagrees with owners"
        free = list(pool._free)
        assert len(free) == len(set(free)) and not set(free) & set(held), "a referenced block is free"
        assert kv.num_free_blocks == N_BLOCKS - len(held), "free count != pool size - blocks in use"
        for h, b in pool.cached.items():
            assert pool.block_hash[b] == h
        for b in held:  # a referenced block keeps its cached identity: never evicted
            h = pool.block_hash[b]
            assert h is None or pool.cached[h] == b


def _request(rid: str, tokens: list[int], group: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(), 8, frozenset(), group_id=group)


PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]]
op = st.one_of(
    st.tuples(st.just("new"), st.integers(0, 2), st.lists(st.integers(1, 5), max_size=9), st.integers(1, 12)),
    st.tuples(st.just("fork"), st.integers(0, 9), st.just([]), st.integers(1, 12)),
    st.tuples(st.just("step"), st.integers(0, 9), st.just([]), st.integers(1, 12)),
    st.tuples(
        st.just("append"), st.integers(0, 9), st.lists(st.integers(1, 5), min_size=1, max_size=3), st.just(1)
    ),
    st.tuples(st.just("free"), st.integers(0, 9), st.just([]), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=60), st.booleans())
def test_block_pool_and_manager_invariants(ops, caching):
    """allocate / append / fork / free / evict / cache-hit in random order: no leaks, correct KV."""
    f = FakeKV(caching)
    counter = 0
    for kind, idx, toks, budget in ops:
        live = list(f.live.values())
        target = live[idx % len(live)] if live else None
        if kind == "new":
            counter += 1
            req = _request(f"r{counter}", PREFIXES[idx] + toks)
            if f.schedule(req, budget):
                f.live[req.request_id] = req
        elif kind == "fork" and target is not None:
            # A sibling with the same prompt (the n samples of one request share a group).
            target.group_id = target.group_id or f"g-{target.request_id}"
            counter += 1
            req = _request(f"r{counter}", list(target.prompt_token_ids), target.group_id)
            if f.schedule(req, budget):
                f.live[req.request_id] = req
        elif kind == "step" and target is not None and target.num_computed_tokens < target.num_tokens:
            f.schedule(target, budget)
        elif kind == "append" and target is not None and target.num_computed_tokens == target.num_tokens:
            for t in toks:  # decode: one token sampled, then computed
                target.append_token(t)
                if not f.schedule(target, 1):
                    break
        elif kind == "free" and target is not None:
            f.kv.free(target)
            del f.live[target.request_id]
        f.check()
    for req in list(f.live.values()):
        f.kv.free(req)
    f.check()
    assert f.kv.num_free_blocks == N_BLOCKS


def test_short_prefix_is_a_query_with_no_hits():
    """A prompt shorter than one block cannot hit: it counts as a query of its tokens, 0 hits."""
    f = FakeKV()
    a = _request("a", [1, 2, 3])
    assert f.kv.get_computed_blocks(a) == []
    f.schedule(a, 8)
    f.kv.record_query(a.num_prompt_tokens, 0)
    assert (f.kv.prefix_cache_queries, f.kv.prefix_cache_hits) == (3, 0)


def test_full_cached_prompt_still_computes_last_token():
    f = FakeKV()
    a = _request("a", list(range(1, 9)))  # exactly two blocks
    f.schedule(a, 8)
    b = _request("b", list(range(1, 9)))
    hits = f.kv.get_computed_blocks(b)
    assert len(hits) == 1  # at most num_tokens - 1 tokens come from the cache


def test_salt_separates_namespaces():
    kv = KVCacheManager(N_BLOCKS, BS)
    a = Request("a", list(range(1, 10)), SamplingParams(), 4, frozenset(), cache_salt="alice")
    kv.allocate_slots(a, 9)
    b = Request("b", list(range(1, 10)), SamplingParams(), 4, frozenset(), cache_salt="bob")
    assert kv.get_computed_blocks(b) == []
    c = Request("c", list(range(1, 10)), SamplingParams(), 4, frozenset(), cache_salt="alice")
    assert len(kv.get_computed_blocks(c)) == 2


# ---- through the engine, against the reference -------------------------------------------------
def _shared_prefix_prompts(tok, n: int) -> list[list[int]]:
    system = tok.encode("The quick brown fox jumps over the lazy dog. " * 6, add_special_tokens=False)
    return [
        system + tok.encode(f" Question {i}: hello world {i * 7}", add_special_tokens=False) for i in range(n)
    ]


def test_prefix_caching_never_changes_greedy_output(tiny_llama_dir):
    """On and off give the same tokens, with a pool so small that cached blocks are evicted."""
    ref = load_reference(tiny_llama_dir)
    params = SamplingParams(temperature=0, max_tokens=20)
    off = LLM(tiny_llama_dir, kv_cache_memory="64MiB", enable_prefix_caching=False)
    prompts = _shared_prefix_prompts(off.tokenizer, 8)
    expected = [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]

    probe = LLM(tiny_llama_dir, kv_cache_memory="1MiB")
    block_bytes = probe.llm_engine.pool_size.block_bytes
    blocks = -(-(max(map(len, prompts)) + 20) // 16) * 3  # room for ~3 requests: forces eviction
    on = LLM(tiny_llama_dir, kv_cache_memory=blocks * block_bytes)
    kv = on.llm_engine.kv_cache_manager
    for round_ in range(3):  # later rounds hit blocks cached (and partly evicted) by earlier ones
        order = prompts if round_ % 2 == 0 else prompts[::-1]
        outs = on.generate(order, params, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        if round_ % 2:
            got = got[::-1]
        for i, p in enumerate(prompts):
            assert_greedy_match(ref, p, expected[i], got[i], f"round {round_} prompt {i}")
        assert kv.num_free_blocks == kv.num_blocks
    assert kv.prefix_cache_hits > 0 and kv.pool.num_evictions > 0


def test_multi_turn_reuses_prompt_and_answer(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_memory="64MiB")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    conv = [{"role": "user", "content": "Tell me about the quick brown fox and the lazy dog."}]
    first = llm.chat(conv, params, use_tqdm=False)[0]
    conv += [{"role": "assistant", "content": first.outputs[0].text}, {"role": "user", "content": "More."}]
    second = llm.chat(conv, params, use_tqdm=False)[0]
    # The answer's tokens may re-tokenize differently at its end; all earlier tokens are shared.
    turn1 = len(first.prompt_token_ids) + len(first.outputs[0].token_ids)
    assert second.num_cached_tokens >= turn1 - 2 * 16, (second.num_cached_tokens, turn1)
    assert second.num_cached_tokens % 16 == 0 and second.num_cached_tokens > len(first.prompt_token_ids) - 16


def _peak_blocks(llm: LLM, prompts, params: SamplingParams, group: str | None) -> int:
    """Most KV blocks in use at once while these requests run."""
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    for i, p in enumerate(prompts):
        engine.add_request(f"{group}-{i}", p, params, group_id=group)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, kv.num_blocks - kv.num_free_blocks)
    return peak


def test_parallel_sampling_shares_the_prompt(tiny_llama_dir):
    """n=8 on a 500-token prompt: the prompt's blocks are held once, not eight times."""
    llm = LLM(tiny_llama_dir, kv_cache_memory="64MiB", enable_prefix_caching=False, max_model_len=512)
    kv = llm.llm_engine.kv_cache_manager
    prompt = (llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 60))[:500]
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=1)

    peak_n8 = _peak_blocks(llm, [prompt] * 8, params, group="one-request")  # the n=8 fan-out
    separate = _peak_blocks(llm, [prompt] * 8, params, group=None)  # caching off: nothing shared
    print(f"peak blocks: n=8 shared {peak_n8}, 8 separate {separate}")
    prompt_blocks = 500 // 16
    assert peak_n8 <= prompt_blocks + 8 * 2 + 1  # one copy of the full blocks + each sample's tail
    assert separate >= 4 * peak_n8
    assert kv.num_free_blocks == kv.num_blocks

    outs = llm.generate([prompt], SamplingParams(n=8, temperature=1.0, max_tokens=8, seed=1), use_tqdm=False)
    assert len(outs[0].outputs) == 8 and len({tuple(c.token_ids) for c in outs[0].outputs}) > 1


def test_priority_requests_jump_the_queue(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_memory="64MiB", scheduling_policy="priority", max_num_seqs=2)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"low-{i}", f"low priority request {i}", params, priority=10)
    engine.step()
    engine.step()  # two low-priority requests are running, four are waiting
    for i in range(2):
        engine.add_request(f"high-{i}", f"urgent request {i}", params, priority=0)
    first_token_step: dict[str, int] = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            first_token_step.setdefault(out.request_id, step)
    waiting_low = [first_token_step[f"low-{i}"] for i in range(2, 6)]
    assert max(first_token_step["high-0"], first_token_step["high-1"]) < min(waiting_low)
    assert engine.scheduler.num_preemptions_total > 0  # they took running seats


def test_fcfs_rejects_unknown_policy(tiny_llama_dir):
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(tiny_llama_dir, scheduling_policy="lottery")
