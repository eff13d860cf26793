"""Scheduler and KV-cache invariants, checked after every engine step on a tiny model with a
small pool; preemption, abort and chunked prefill; and a property test of the block manager."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.core.block_pool import BlockPool
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.request import Request, RequestStatus

BLOCK_BYTES = 16 * 512  # one 16-token KV block of the tiny models


def make_llm(path: str, num_blocks: int = 64, **kwargs) -> LLM:
    return LLM(path, kv_cache_memory=num_blocks * BLOCK_BYTES, **kwargs)


def record_schedules(engine) -> list:
    """Wrap the engine's scheduler so every step's SchedulerOutput is kept."""
    sched = engine.scheduler
    outs: list = []
    original = sched.schedule

    def schedule():
        out = original()
        outs.append(out)
        return out

    sched.schedule = schedule
    return outs


def check_invariants(engine, sched_out) -> None:
    kv = engine.kv_cache_manager
    s = engine.scheduler
    bs = kv.block_size
    held = {rid: blocks for rid, blocks in kv.req_to_blocks.items() if blocks}
    running_ids = {r.request_id for r in s.running}
    assert set(held) <= running_ids, (
        f"blocks held by requests that are not running: {set(held) - running_ids}"
    )
    for req in s.running:
        n_blocks = len(kv.get_block_ids(req.request_id))
        assert n_blocks == -(-req.num_computed_tokens // bs), (req, n_blocks)
        assert 0 <= n_blocks * bs - req.num_computed_tokens < bs or req.num_computed_tokens == 0
        assert req.num_computed_tokens <= req.num_tokens
        assert req.status == RequestStatus.RUNNING
    for req in s.waiting:
        assert not kv.get_block_ids(req.request_id) and req.num_computed_tokens == 0
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    all_held = [b for blocks in held.values() for b in blocks]
    assert len(all_held) == len(set(all_held)), "a block is owned twice"
    assert kv.num_free_blocks + len(all_held) == kv.num_blocks
    ref = kv.pool.ref_cnt
    assert all(ref[b] == 1 for b in all_held)
    assert sum(ref) == len(all_held)
    assert len(s.running) <= s.max_num_seqs
    assert sched_out.total_tokens <= s.max_num_batched_tokens
    assert all(n >= 1 for _, n in sched_out.scheduled)
    ids = [r.request_id for r, _ in sched_out.scheduled]
    assert len(ids) == len(set(ids)), "a request scheduled twice in one step"


def run_checked(engine, max_steps: int) -> dict:
    outs = record_schedules(engine)
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        n_before = len(outs)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in final, "finished twice"
                final[out.request_id] = out
        if len(outs) > n_before:
            check_invariants(engine, outs[-1])
    else:
        raise AssertionError(f"still unfinished after {max_steps} steps: livelock?")
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert not engine.scheduler.requests
    return final


PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! 0123456789",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Continuous batching schedules every step.",
    "héllo wörld — naïve café",
    "0123456789 0123456789 0123456789",
]


def test_invariants_hold_every_step_with_mixed_requests(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, num_blocks=12, max_num_batched_tokens=20, max_num_seqs=3)
    e = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        e.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=10 + 5 * i, ignore_eos=True))
    final = run_checked(e, max_steps=500)
    assert set(final) == {str(i) for i in range(len(PROMPTS))}
    for i in range(len(PROMPTS)):
        c = final[str(i)].outputs[0]
        assert len(c.token_ids) == 10 + 5 * i and c.finish_reason == "length"


def test_preemption_under_a_small_pool_still_finishes(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)
    big = make_llm(tiny_llama_dir)
    expected = [o.outputs[0].token_ids for o in big.generate(PROMPTS, params, use_tqdm=False)]
    assert big.llm_engine.scheduler.num_preemptions_total == 0

    # Every request needs 3-4 blocks; 6 requests need ~20; the pool has 7.
    llm = make_llm(tiny_llama_dir, num_blocks=7, max_num_batched_tokens=64)
    e = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        e.add_request(str(i), p, params)
    final = run_checked(e, max_steps=2000)
    assert e.scheduler.num_preemptions_total > 0
    assert sum(o.metrics.num_preemptions for o in final.values()) == e.scheduler.num_preemptions_total
    for i in range(len(PROMPTS)):
        c = final[str(i)].outputs[0]
        assert c.finish_reason == "length" and len(c.token_ids) == 36
        # Recompute after preemption continues the same greedy sequence (fp32, peaked tiny model).
        assert c.token_ids == expected[i]


def test_preempted_requests_keep_first_prompt_logprobs(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True, prompt_logprobs=1)
    ref = make_llm(tiny_llama_dir).generate(PROMPTS, params, use_tqdm=False)
    llm = make_llm(tiny_llama_dir, num_blocks=7)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    for r, o in zip(ref, outs):
        assert len(o.prompt_logprobs) == len(o.prompt_token_ids)
        assert o.prompt_logprobs[0] is None
        # each prompt token's rank travels beside its entry: recorded once, in step with it
        assert o.prompt_logprob_ranks == r.prompt_logprob_ranks and len(o.prompt_logprob_ranks) == len(
            o.prompt_token_ids
        )
        for a, b in zip(r.prompt_logprobs[1:], o.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_max_num_seqs_limits_running(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, max_num_seqs=2)
    e = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        e.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    outs = record_schedules(e)
    peak = 0
    while e.has_unfinished_requests():
        e.step()
        peak = max(peak, len(e.scheduler.running))
        check_invariants(e, outs[-1])
        assert len(outs[-1].scheduled) <= 2
    assert peak == 2


def test_abort_running_and_waiting_frees_blocks_now(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, num_blocks=8, max_num_seqs=1)
    e = llm.llm_engine
    kv = e.kv_cache_manager
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    e.add_request("run", PROMPTS[2], params)
    e.add_request("wait", PROMPTS[0], params)
    for _ in range(3):
        e.step()
    run = e.scheduler.requests["run"]
    assert run.status == RequestStatus.RUNNING and kv.get_block_ids("run")
    assert e.scheduler.requests["wait"].status == RequestStatus.WAITING
    assert kv.num_free_blocks < kv.num_blocks

    e.abort_request(["run", "wait", "no-such-id"])
    assert kv.num_free_blocks == kv.num_blocks, "abort must free blocks immediately"
    assert not e.scheduler.running and not e.scheduler.waiting
    assert e.has_unfinished_requests(), "the abort outputs are still to be reported"
    outs = {o.request_id: o for o in e.step()}
    assert set(outs) == {"run", "wait"}
    for o in outs.values():
        assert o.finished and o.outputs[0].finish_reason == "abort"
    assert len(outs["run"].outputs[0].token_ids) == 3
    assert outs["wait"].outputs[0].token_ids == []
    assert outs["run"].metrics.finished_time is not None
    assert not e.has_unfinished_requests() and e.step() == []
    e.abort_request("run")  # aborting a finished request is a no-op
    assert not e.has_unfinished_requests()


def test_abort_preempted_and_mid_prefill_requests(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, num_blocks=5, max_num_batched_tokens=8)
    e = llm.llm_engine
    kv = e.kv_cache_manager
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(3):
        e.add_request(str(i), PROMPTS[i], params)
    reqs = dict(e.scheduler.requests)
    outs = record_schedules(e)
    e.step()
    mid = [r for r, n in outs[-1].scheduled if r.num_computed_tokens < r.num_prompt_tokens]
    assert mid, "a prompt should still be mid-prefill after one 8-token step"
    e.abort_request(mid[0].request_id)
    assert not kv.get_block_ids(mid[0].request_id) and kv.num_free_blocks == kv.num_blocks
    victim = None
    aborted = {}
    for _ in range(200):
        aborted.update({o.request_id: o for o in e.step() if o.finished})
        check_invariants(e, outs[-1])
        victim = next((r for r in reqs.values() if r.num_preemptions and not r.is_finished), None)
        if victim is not None or not e.has_unfinished_requests():
            break
    assert victim is not None, "two 50-token requests in a 5-block pool: one must be preempted"
    others = sum(len(kv.get_block_ids(r.request_id)) for r in e.scheduler.running if r is not victim)
    e.abort_request(victim.request_id)
    assert kv.num_free_blocks == kv.num_blocks - others
    assert aborted[mid[0].request_id].outputs[0].finish_reason == "abort"
    final = run_checked(e, max_steps=500)
    assert final[victim.request_id].outputs[0].finish_reason == "abort"
    assert [o.outputs[0].finish_reason for o in final.values()].count("length") == 1


def test_preempted_request_is_not_readmitted_in_the_same_step(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, num_blocks=5, max_num_batched_tokens=8)
    e = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in (1, 2):
        e.add_request(str(i), PROMPTS[i], params)
    reqs = dict(e.scheduler.requests)
    outs = record_schedules(e)
    readmitted = []
    for _ in range(300):
        if not e.has_unfinished_requests():
            break
        before = {rid: r.num_preemptions for rid, r in reqs.items()}
        e.step()
        victims = {rid for rid, r in reqs.items() if r.num_preemptions > before[rid]}
        readmitted += [r.request_id for r, _ in outs[-1].scheduled if r.request_id in victims]
    assert e.scheduler.num_preemptions_total > 0
    assert not readmitted, f"preempted and rescheduled in the same step: {readmitted}"


def test_chunked_prefill_shares_steps_with_decodes(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=7)
    e = llm.llm_engine
    tok = e.tokenizer
    long_prompt = (tok.encode(" ".join(PROMPTS)) * 2)[:40]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref_long = (
        make_llm(tiny_llama_dir).generate([long_prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    )

    outs = record_schedules(e)
    e.add_request("dec", tok.encode("Hello"), greedy)
    dec = e.scheduler.requests["dec"]
    e.step()
    assert len(dec.output_token_ids) == 1
    e.add_request("long", long_prompt, greedy)
    long = e.scheduler.requests["long"]
    steps = 0
    while not long.output_token_ids:
        n_dec = len(dec.output_token_ids)
        e.step()
        steps += 1
        check_invariants(e, outs[-1])
        sched = {r.request_id: n for r, n in outs[-1].scheduled}
        assert sched.get("dec") == 1, "the decode must run in every step"
        assert 1 <= sched.get("long", 0) <= 6
        assert len(dec.output_token_ids) == n_dec + 1
    assert steps >= 6  # 40 prompt tokens through at most 6 per step
    assert long.num_computed_tokens == 40
    final = run_checked(e, max_steps=200)
    assert final["long"].outputs[0].token_ids == ref_long  # chunking does not change the result


def test_default_budget_prefills_in_one_step(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    e = llm.llm_engine
    e.add_request("x", [5] * 100, SamplingParams(max_tokens=2, ignore_eos=True))
    req = e.scheduler.requests["x"]
    e.step()
    assert req.num_computed_tokens == 100 and len(req.output_token_ids) == 1


# ---- block manager alone (no model) ------------------------------------------------------------------
BS = 4
N_BLOCKS = 10
N_REQS = 4

ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, N_REQS - 1), st.integers(0, 25), st.booleans()),
        st.tuples(st.just("free"), st.integers(0, N_REQS - 1), st.just(0), st.just(False)),
    ),
    max_size=40,
)


def _check_manager(kv: KVCacheManager) -> None:
    held = [b for blocks in kv.req_to_blocks.values() for b in blocks]
    free = list(kv.pool._free)
    assert len(held) == len(set(held)), "a block is owned twice"
    assert len(free) == len(set(free)), "a block is free twice"
    assert not set(held) & set(free), "a block is both free and owned"
    assert sorted(held + free) == list(range(N_BLOCKS)), "a block leaked"
    assert kv.num_free_blocks == N_BLOCKS - len(held)
    for b in range(N_BLOCKS):
        assert kv.pool.ref_cnt[b] == (1 if b in held else 0)
    assert kv.usage() == pytest.approx(len(held) / N_BLOCKS)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_kv_cache_manager_property(operations):
    kv = KVCacheManager(N_BLOCKS, BS, enable_prefix_caching=False)  # tests/test_prefix_cache.py has the rest
    reqs = [Request(f"r{i}", list(range(1, 100)), SamplingParams(), 1, frozenset()) for i in range(N_REQS)]
    for op, i, n, compute in operations:
        req = reqs[i]
        if op == "alloc":
            before = {rid: list(b) for rid, b in kv.req_to_blocks.items()}
            free_before = list(kv.pool._free)
            have = len(before.get(req.request_id, []))
            want = -(-(req.num_computed_tokens + n) // BS)
            ok = kv.allocate_slots(req, n)
            assert ok == (want - have <= len(free_before))
            after = {rid: b for rid, b in kv.req_to_blocks.items() if b}
            if not ok:
                # Nothing at all changed (an empty table entry is not an allocation).
                assert after == {rid: b for rid, b in before.items() if b}
                assert list(kv.pool._free) == free_before
            else:
                mine = kv.get_block_ids(req.request_id)
                assert len(mine) == max(have, want)
                assert mine[:have] == before.get(req.request_id, [])
                assert set(mine[have:]) <= set(free_before)
                for rid, b in before.items():
                    if rid != req.request_id:
                        assert kv.req_to_blocks[rid] == b
                if compute:
                    req.num_computed_tokens += n
        else:
            kv.free(req)
            req.num_computed_tokens = 0
            assert kv.get_block_ids(req.request_id) == []
        _check_manager(kv)
    for req in reqs:
        kv.free(req)
    assert kv.num_free_blocks == N_BLOCKS and sum(kv.pool.ref_cnt) == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["alloc", "incref", "free"]), st.integers(0, 6), st.integers(0, 9)))
)
def test_block_pool_reference_counts(operations):
    pool = BlockPool(N_BLOCKS)
    refs = {}  # model: block -> reference count
    owners: list[list[int]] = []  # every reference handed out, as lists of blocks
    for op, n, pick in operations:
        if op == "alloc":
            if n > pool.num_free_blocks:
                free_before = pool.num_free_blocks
                with pytest.raises(RuntimeError):
                    pool.allocate(n)
                assert pool.num_free_blocks == free_before
                continue
            blocks = pool.allocate(n)
            assert len(blocks) == n and not set(blocks) & set(refs)
            refs.update(dict.fromkeys(blocks, 1))
            owners.append(blocks)
        elif op == "incref" and owners:
            blocks = owners[pick % len(owners)]
            pool.touch(blocks)
            for b in blocks:
                refs[b] += 1
            owners.append(list(blocks))
        elif op == "free" and owners:
            blocks = owners.pop(pick % len(owners))
            pool.free(blocks)
            for b in blocks:
                refs[b] -= 1
                if refs[b] == 0:
                    del refs[b]
        assert pool.num_free_blocks == N_BLOCKS - len(refs)
        assert all(pool.ref_cnt[b] == refs.get(b, 0) for b in range(N_BLOCKS))
        assert sorted(set(pool._free)) == sorted(b for b in range(N_BLOCKS) if b not in refs)
    for blocks in owners:
        pool.free(blocks)
    assert pool.num_free_blocks == N_BLOCKS


def test_block_pool_rejects_double_free_and_empty_pool():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(AssertionError):
        pool.free(blocks)
    with pytest.raises(ValueError):
        BlockPool(0)


def test_the_core_reports_the_background_tiers_load_apart(tiny_llama_dir):
    """Batch lines (BACKGROUND_PRIORITY) counted in the core's running / waiting / KV numbers
    alone, so /metrics read a batch as a full replica; the core now reports their share too
    (metrics/prometheus.py leaves it out of saturation), and their outputs say they are
    background (out of the latency histograms), wherever a step's newcomers sit in `running`."""
    from kvserve.request import BACKGROUND_PRIORITY

    llm = make_llm(tiny_llama_dir, max_num_seqs=2)
    e = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i in range(3):
        e.add_request(f"b{i}", PROMPTS[i], params, priority=BACKGROUND_PRIORITY)
    core = e.core.step()
    assert (core.num_running_background, core.num_waiting_background) == (2, 1)
    assert core.kv_cache_usage_background == core.kv_cache_usage > 0
    outs, _ = e.output_processor.process(core.outputs)
    assert {o.request_id: o.metrics.background for o in outs} == {"b0": True, "b1": True}
    e.add_request("i", PROMPTS[3], params)
    core = e.core.step()
    assert (core.num_running, core.num_running_background) == (2, 1)  # the interactive one took a seat
    assert (core.num_waiting, core.num_waiting_background) == (2, 2)
    assert 0 < core.kv_cache_usage_background < core.kv_cache_usage
    outs, _ = e.output_processor.process(core.outputs)
    assert {o.request_id: o.metrics.background for o in outs} == {"i": False}  # (b0 holds its seat)
    e.abort_request(["b0", "b1", "b2", "i"], report=False)
