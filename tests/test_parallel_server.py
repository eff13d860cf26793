"""`kvserve serve --tensor-parallel-size 2` end to end: greedy completions equal the offline
single-process engine (and so does `--pipeline-parallel-size 2`); killing a rank (SIGKILL) or
hanging one (SIGSTOP) mid-generation fails the in-flight requests, turns /health 503 within
2 s, and leaves no rank process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import psutil
from server_utils import ServerProcess
from test_server import LONG, MODEL_ARGS

from kvserve import LLM, SamplingParams


def _rank_pids(s: ServerProcess) -> list[int]:
    return [
        c.pid
        for c in psutil.Process(s.proc.pid).children(recursive=True)
        if "kvserve.executor.worker_proc" in " ".join(c.cmdline())
    ]


def test_tp2_server_greedy_and_rank_death(tiny_llama_dir):
    prompts = ["Hello world", "The quick brown fox", "A paged KV cache stores"]
    offline = LLM(tiny_llama_dir, kv_cache_memory="32MiB", max_model_len=256)
    expected = [
        o.outputs[0].text for o in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    ]
    s = ServerProcess(tiny_llama_dir, *MODEL_ARGS, "--tensor-parallel-size", "2", "--max-num-seqs", "4")
    try:
        pids = _rank_pids(s)
        assert len(pids) == 2
        for prompt, want in zip(prompts, expected):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0}
            r = httpx.post(f"{s.url}/v1/completions", json=body, headers=s.headers, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want

        _fail_a_rank(s, pids, signal.SIGKILL)
    finally:
        s.stop()
    _assert_gone(pids)


def test_tp2_server_hung_rank(tiny_llama_dir):
    """SIGSTOP: the rank neither exits nor errs; its missing heartbeats fail the engine."""
    s = ServerProcess(tiny_llama_dir, *MODEL_ARGS, "--tensor-parallel-size", "2", "--max-num-seqs", "4")
    try:
        pids = _rank_pids(s)
        _fail_a_rank(s, pids, signal.SIGSTOP)
    finally:
        s.stop()
    _assert_gone(pids)


def _fail_a_rank(s: ServerProcess, pids: list[int], sig: int) -> None:
    """Send `sig` to rank 1 while 8 long requests run: they end in 5xx soon after, /health
    turns 503 (a dead rank within ~0.1 s, a hung one after HANG_S = 1 s of silence; the bound
    leaves margin for shared CI cores)."""

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as http:
            url = f"{s.url}/v1/completions"
            tasks = [asyncio.create_task(http.post(url, json=LONG, headers=s.headers)) for _ in range(8)]
            await asyncio.sleep(0.5)
            os.kill(pids[1], sig)
            killed = time.monotonic()
            results = await asyncio.gather(*tasks)
            return killed, time.monotonic(), results

    killed, done, results = asyncio.run(scenario())
    codes = [r.status_code for r in results]
    assert any(c >= 500 for c in codes) and set(codes) <= {200, 500, 503}, codes
    # Detection is bounded (~0.1 s dead, HANG_S = 1 s hung); the rest is the core process
    # exiting and the API noticing, which on 2 cores shared with other test runs (load 10+)
    # was measured at up to ~4 s: the margin is for that.
    assert done - killed < 6.0
    t0 = time.monotonic()
    while httpx.get(f"{s.url}/health").status_code != 503:
        assert time.monotonic() - t0 < 2.0
        time.sleep(0.05)


def _assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, "a rank process outlived the server"
        time.sleep(0.1)


def test_pp2_server_greedy_and_stage_death(tiny_llama_dir):
    """`kvserve serve --pipeline-parallel-size 2`: the same completions as the offline single
    process; a killed stage fails in-flight requests and /health."""
    prompts = ["Hello world", "The quick brown fox"]
    offline = LLM(tiny_llama_dir, kv_cache_memory="32MiB", max_model_len=256)
    expected = [
        o.outputs[0].text for o in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    ]
    s = ServerProcess(tiny_llama_dir, *MODEL_ARGS, "--pipeline-parallel-size", "2", "--max-num-seqs", "4")
    try:
        pids = _rank_pids(s)
        assert len(pids) == 2
        for prompt, want in zip(prompts, expected):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0}
            r = httpx.post(f"{s.url}/v1/completions", json=body, headers=s.headers, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
        # Each of the 2 stages' batch streams seats 2 of the 4: 3 beams, which run together, never
        # fit one. The engine core refused them (its own check) and that came back as a 500.
        body = {"model": "tiny", "prompt": prompts[0], "max_tokens": 4, "use_beam_search": True, "n": 3}
        r = httpx.post(f"{s.url}/v1/completions", json=body, headers=s.headers, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "n" and "seats for one group: 2" in r.json()["error"]["message"]
        _fail_a_rank(s, pids, signal.SIGKILL)
    finally:
        s.stop()
    _assert_gone(pids)
