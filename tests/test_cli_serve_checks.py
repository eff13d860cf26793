"""`kvserve serve` settings found unusable before the engine starts: one line, exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("where", ["a-file", "a-file/sub"])
def test_an_unusable_batch_storage_dir_stops_serve_at_once(where, tiny_llama_dir, tmp_path):
    """The folder was first opened once the model had loaded, and its error left the engine
    running: the command printed the error and never exited."""
    (tmp_path / "a-file").write_text("not a folder")
    storage = str(tmp_path / where)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", tiny_llama_dir, "--port", "0",
           "--kv-cache-memory", "4MiB", "--batch-storage-dir", storage]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert out.returncode == 2, out.stderr
    said = [line for line in out.stderr.splitlines() if not line.startswith("INFO")]
    assert said == [
        f"error: batch-storage-dir: cannot keep the Batch API's files in {storage!r}: Not a directory"
    ]


def test_a_port_in_use_stops_serve_before_the_model_loads(tiny_llama_dir):
    """It was uvicorn's "address already in use" and exit status 3, once the engine had started."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", tiny_llama_dir, "--port", str(port),
               "--kv-cache-memory", "4MiB"]  # fmt: skip
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        f"error: port: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]


def test_a_host_this_machine_does_not_have_stops_serve_before_the_model_loads(tmp_path, capsys):
    from kvserve.entrypoints.cli import main

    assert main(["serve", str(tmp_path / "no-model"), "--host", "no-such-host.invalid"]) == 2
    assert capsys.readouterr().err.startswith("error: host: cannot listen on 'no-such-host.invalid': ")


@pytest.mark.parametrize("flag", ["--served-model-name", "--allowed-origins"])
def test_a_model_swallowed_by_a_list_flag_is_refused(flag, tiny_llama_dir):
    """`kvserve serve --served-model-name foo ./model`: the list took the model's path as a second
    value and the default model was served, under both names."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [
        sys.executable,
        "-m",
        "kvserve.entrypoints.cli",
        "serve",
        "--port",
        "0",
        flag,
        "foo",
        tiny_llama_dir,
    ]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    name = flag.removeprefix("--")
    assert out.stderr.splitlines() == [
        f"error: {name}: {tiny_llama_dir!r} looks like the model, taken as a {flag} value (the default model "
        f"would be served); give the model first: kvserve serve MODEL {flag} ..."
    ]


def test_list_flags_after_the_model_or_without_paths_are_taken(tiny_llama_dir):
    from kvserve.entrypoints.cli import _swallowed_model, build_parser

    for argv in (
        ["serve", tiny_llama_dir, "--served-model-name", "foo", "bar"],
        ["serve", "--served-model-name", "foo", "bar"],  # names only: the default model, as asked
    ):
        assert _swallowed_model(build_parser().parse_args(argv)) is None


def test_a_failure_building_the_app_stops_the_engine_and_exits(tiny_llama_dir, monkeypatch, capsys):
    """An exception in build_app, once the engine core had loaded the model, printed a stack and
    left the command hanging at exit (multiprocessing joins a daemon core it sent SIGTERM to,
    which the core ignores), the core running."""
    import kvserve.entrypoints.openai.api_server as api_server
    from kvserve.entrypoints.cli import main

    engines = []

    def broken(engine, *args):
        engines.append(engine)
        raise TypeError("no app today")

    monkeypatch.setattr(api_server, "build_app", broken)
    assert main(["serve", tiny_llama_dir, "--port", "0", "--kv-cache-memory", "4MiB"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: the server could not start: TypeError: no app today"
    )
    (engine,) = engines
    engine.proc.join(5)
    assert not engine.proc.is_alive()


def test_a_kv_pool_smaller_than_one_full_sequence_stops_serve(tiny_llama_dir, capsys):
    """A pool of 8 blocks (128 tokens) under a 256-token context started, and refused every
    request past 128 tokens; vLLM refuses it at start, saying what to change."""
    import psutil

    from kvserve.entrypoints.cli import main

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    argv = ["serve", tiny_llama_dir, "--port", "0", "--kv-cache-memory", "64KiB", "--max-model-len", "256"]
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: kv_cache_memory: the KV pool holds 128 tokens (8 blocks of 16), less than one sequence of "
        "max_model_len 256 tokens (16 blocks); raise --kv-cache-memory to at least 128KiB (on a GPU without "
        "it, --gpu-memory-utilization) or lower --max-model-len to at most 128"
    )
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    left = [
        p for p in left if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in p.cmdline()[-1]
    ]
    assert not left, left  # multiprocessing's resource tracker lives as long as this process


def test_the_pool_check_counts_whole_blocks_of_one_sequence():
    """Exactly one max_model_len sequence's blocks pass; one block fewer is short (and, under the
    model's own context, only warned of: serve refuses it where --max-model-len was given)."""
    from kvserve.engine.core_proc import Ready
    from kvserve.entrypoints.openai.pool_check import short_pool_error

    def ready(blocks: int, max_model_len: int) -> Ready:
        return Ready(512, max_model_len, blocks, 16, blocks * 16 * 46080, 1)

    assert short_pool_error(ready(512, 8192)) is None and short_pool_error(ready(16, 241)) is None
    assert short_pool_error(ready(511, 8192)).endswith(
        "raise --kv-cache-memory to at least 360MiB (on a GPU without it, --gpu-memory-utilization) or "
        "lower --max-model-len to at most 8176"
    )
