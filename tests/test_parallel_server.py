"""`kvserve serve --tensor-parallel-size 2` end to end: greedy completions equal the offline
single-process engine; killing a rank mid-generation fails the in-flight requests, turns
/health 503 within 2 s, and leaves no rank process behind."""

from __future__ import annotations

import time

import httpx
import psutil
from server_utils import ServerProcess
from test_server import LONG, MODEL_ARGS, _post_many

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

        s.engine_core_pid = lambda: pids[1]  # _post_many kills "the engine core": here, rank 1
        killed, done, results = _post_many(s, LONG, 8, kill_after=0.5)
        codes = [r.status_code for r in results]
        assert any(c >= 500 for c in codes) and set(codes) <= {200, 500, 503}, codes
        assert done - killed < 2.0
        t0 = time.monotonic()
        while httpx.get(f"{s.url}/health").status_code != 503:
            assert time.monotonic() - t0 < 2.0
            time.sleep(0.05)
    finally:
        s.stop()
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, "a rank process outlived the server"
        time.sleep(0.1)
