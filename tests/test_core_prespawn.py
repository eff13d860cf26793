"""`kvserve serve` starts its engine core before its own heavy imports (engine/core_prespawn.py):
the command line (and the gateway, the pd-proxy) imports no torch, a prespawned process started
on its config becomes the first core and serves greedy tokens equal to an offline engine's, a
restarted core is spawned anew, and a server that stops on a bad flag kills the process it
prespawned."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import psutil

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.async_llm import AsyncLLM
from kvserve.engine.core_prespawn import PrespawnedCore, start_cores

ENGINE = {"kv_cache_memory": "8MiB", "max_model_len": 256}


def test_the_command_line_imports_no_torch():
    """Nor do the gateway and the pd-proxy, which never run a model (each carried ~200 MB of
    torch and a second of its import before)."""
    code = (
        "import sys, kvserve.entrypoints.cli, kvserve.engine.core_prespawn\n"
        "import kvserve.gateway.app, kvserve.disagg.proxy\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "import kvserve\n"
        "assert kvserve.SamplingParams(max_tokens=3).max_tokens == 3\n"  # the lazy names resolve
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_api_process_of_a_gguf_server_imports_no_torch():
    """It never runs the model: its modules, the configuration's checks and a GGUF's tokenizer
    need no torch (~1 s of its start and ~180 MB of its memory with the default model). An HF
    directory's tokenizer still brings it: transformers' AutoTokenizer imports it."""
    code = (
        "import sys\n"
        "import kvserve.entrypoints.openai.api_server, kvserve.engine.async_llm\n"
        "from kvserve.config import EngineConfig\n"
        "from kvserve.model.loader import load_tokenizer, resolve_model\n"
        "EngineConfig(model='smollm2-135m', quantization='int4', kv_cache_dtype='int8')\n"
        "tok = load_tokenizer(resolve_model('smollm2-135m'))\n"
        "assert tok.encode('hello') and 'torch' not in sys.modules, 'torch imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def _greedy(engine: AsyncLLM, prompt: str, n: int) -> list[int]:
    async def run() -> list[int]:
        engine.start()
        stream = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        last = None
        async for out in stream:
            last = out
        return list(last.outputs[0].token_ids)

    return asyncio.run(run())


def test_the_prespawned_process_is_the_first_core_and_a_restart_spawns_anew(tiny_llama_dir):
    """Started before the engine client exists (it loads while `kvserve serve` imports the
    server), the core connects to addresses nobody has bound yet; its Ready waits for the client."""
    config = EngineConfig(model=tiny_llama_dir, **ENGINE)
    pre = PrespawnedCore()
    start_cores([pre], config, "cache-aware")
    engine = AsyncLLM(config, prespawned=pre)
    try:
        assert engine.proc is pre.proc and engine.proc.is_alive()
        assert (engine._in_addr, engine._out_addr) == pre.args[1:3]
        got = _greedy(engine, "the quick brown fox", 12)
        pre.cancel()  # taken already: no effect
        assert engine.proc.is_alive()
        engine.proc.kill()
        engine.proc.join(10)
        engine._open_sockets()
        engine._spawn_core()  # as AsyncLLM's supervisor does after a crash
        assert engine.proc is not pre.proc and engine._in_addr != pre.args[1]
    finally:
        engine.shutdown()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (want,) = LLM(tiny_llama_dir, **ENGINE).generate(["the quick brown fox"], params, use_tqdm=False)
    assert got == list(want.outputs[0].token_ids)


def test_a_core_started_with_other_options_is_replaced(tiny_llama_dir):
    """A prespawned core is only used for the config and options it was started with."""
    config = EngineConfig(model=tiny_llama_dir, **ENGINE)
    pre = PrespawnedCore()
    pre.start(config, num_threads=1)
    engine = AsyncLLM(config, prespawned=pre)  # num_threads=None
    try:
        assert engine.proc is not pre.proc and not pre.proc.is_alive()
        assert engine.proc.is_alive()
    finally:
        engine.shutdown()


def test_cancel_kills_an_unused_core_at_once(tiny_llama_dir):
    """Still importing, or already loading the model (a bad server flag found after the start)."""
    importing, loading = PrespawnedCore(), PrespawnedCore()
    loading.start(EngineConfig(model=tiny_llama_dir, **ENGINE))
    t0 = time.monotonic()
    importing.cancel()
    loading.cancel()
    assert not importing.proc.is_alive() and not loading.proc.is_alive() and time.monotonic() - t0 < 5


def test_a_bad_flag_leaves_no_engine_process(tiny_llama_dir):
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", tiny_llama_dir, "--kv-cache-memory", "x"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children: set[int] = set()
    while proc.poll() is None:  # note every process it starts, while it runs
        try:
            children |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            break
        time.sleep(0.02)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "kv_cache_memory" in err, err[-2000:]
    time.sleep(0.5)
    alive = [pid for pid in children if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert not alive, alive


def test_data_parallel_replicas_take_one_prespawned_core_each(tiny_llama_dir):
    from kvserve.engine.dp_client import DPClient

    config = EngineConfig(model=tiny_llama_dir, data_parallel_size=2, **ENGINE)
    cores = [PrespawnedCore(), PrespawnedCore()]
    start_cores(cores, config, "cache-aware")
    dp = DPClient(config, 2, "cache-aware", prespawned=cores)
    try:
        assert [r.engine.proc for r in dp.replicas] == [c.proc for c in cores]
        assert all(r.engine.proc.is_alive() for r in dp.replicas)
    finally:
        dp.shutdown()
