"""The Ray executor on a real local Ray head started here (`ray start --head --num-cpus 2`,
stopped afterwards): greedy output with TP=2 and with PP=2 through Ray actors equals the
single process and the Hugging Face reference; the actors are gone after shutdown; a hung
(SIGSTOP) actor fails the engine through its missing heartbeats."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import load_reference
from helpers import assert_greedy_match, reference_greedy
from server_utils import free_port
from test_parallel import _alive, _greedy, _prompts, _shutdown

from kvserve import LLM, SamplingParams
from kvserve.executor.multiproc import HANG_S, RankFailure

ray = pytest.importorskip("ray")

GREEDY = SamplingParams(temperature=0, max_tokens=20)


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head on a free port for this module; RAY_ADDRESS points the engine at it."""
    cli = os.path.join(os.path.dirname(sys.executable), "ray")
    port = free_port()
    subprocess.run(
        [cli, "start", "--head", "--num-cpus", "2", "--port", str(port), "--include-dashboard=false",
         "--disable-usage-stats"],
        check=True, capture_output=True, timeout=180,
    )  # fmt: skip
    old = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    try:
        yield os.environ["RAY_ADDRESS"]
    finally:
        ray.shutdown()
        subprocess.run([cli, "stop", "--force"], capture_output=True, timeout=120)
        if old is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = old


@pytest.mark.parametrize(
    "layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"]
)
def test_ray_greedy_equals_one_process_and_reference(ray_head, tiny_llama_dir, layout):
    ref = load_reference(tiny_llama_dir)
    prompts = _prompts(500, [3, 9, 30, 57], shared=20)
    kw = dict(kv_cache_memory="2MiB", max_num_batched_tokens=32, max_model_len=256)
    one = LLM(tiny_llama_dir, **kw)
    base = _greedy(one, prompts)
    llm = LLM(tiny_llama_dir, distributed_executor_backend="ray", **layout, **kw)
    executor = llm.llm_engine.core.executor
    try:
        assert type(executor).__name__ == "RayExecutor"
        pids = executor.pids
        assert len(pids) == 2 and os.getpid() not in pids
        got = _greedy(llm, prompts)
    finally:
        _shutdown(llm)
    eos = sorted(one.llm_engine.eos_token_ids)
    for i, p in enumerate(prompts):
        expected = reference_greedy(ref, p, GREEDY.max_tokens, eos)
        assert_greedy_match(ref, p, expected, base[i], f"one process vs reference, prompt {i}")
        assert_greedy_match(ref, p, base[i], got[i], f"Ray {layout} vs one process, prompt {i}")
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "a rank actor outlived shutdown"


def test_ray_hung_actor_fails_the_engine(ray_head, tiny_llama_dir):
    """SIGSTOP one rank's actor process mid-generation: its heartbeats stop, the step raises
    RankFailure after HANG_S (1 s; the bound leaves margin for shared cores), and the actors
    are gone afterwards."""
    llm = LLM(
        tiny_llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray", kv_cache_memory="1MiB"
    )
    engine = llm.llm_engine
    pids = engine.core.executor.pids
    engine.add_request(
        "a", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    )
    engine.step()
    os.kill(pids[1], signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 sent no heartbeat"):
        for _ in range(2000):
            engine.step()
    assert time.monotonic() - t0 < 2.0 + HANG_S
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "a rank actor outlived the failed engine"
