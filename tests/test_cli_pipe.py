"""`kvserve ... | head`: the reader of stdout leaves before the command is done writing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_closed_stdout_pipe_ends_the_command_without_a_traceback():
    """`kvserve plan Llama-3.1-8B --json | head -3` printed a BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)  # the reader has gone before the first write: every write fails
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "plan", "Llama-3.1-8B", "--json"]
    try:
        out = subprocess.run(
            cmd, cwd=ROOT, env=env, stdout=write, stderr=subprocess.PIPE, text=True, timeout=60
        )
    finally:
        os.close(write)
    assert out.returncode == 141, out.stderr
    assert "Traceback" not in out.stderr and "BrokenPipeError" not in out.stderr, out.stderr
