"""How long `kvserve serve` takes to answer /health/ready, and what the gateway's import costs.

A server start is two processes importing torch and kvserve (the API process and the engine
core) and then the model loading; tests start a server dozens of times, and a user waits for
one after every restart. Each round starts, from each tree in alternating order, `kvserve
serve` on a tiny random Llama (built in a temp dir) and on the default model with `make serve`'s
flags, timing from the process's start to /health/ready answering 200 (with the API process's
memory then), then stops it; and times `import kvserve.gateway.app` in a fresh interpreter (what
`kvserve gateway` and the pd-proxy import before they listen), with the memory it holds then.
Prints each case's median per tree and, with `--baseline-tree DIR` (e.g. `git archive <commit> |
tar -x -C DIR`), this tree's median over the baseline's. Prints the CPU flags and the load average.

    python benchmarks/bench_startup.py [--rounds 5] [--baseline-tree DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import httpx  # noqa: E402
import psutil  # noqa: E402
from server_utils import free_port  # noqa: E402

from benchmarks.common import run_header  # noqa: E402
from benchmarks.tree_compare import add_tree_options, compared_trees  # noqa: E402

MAKE_SERVE = ["--quantization", "int4", "--kv-cache-dtype", "int8", "--long-prefill-token-threshold", "48"]


def serve_ready_s(tree: str, model: str, flags: list[str]) -> tuple[float, float]:
    """Seconds from starting `kvserve serve` from `tree` to its /health/ready answering 200, and
    the API process's RSS in MiB then (its engine core is another process)."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", model, "--port", str(port), *flags]
    env = {**os.environ, "PYTHONPATH": tree}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvserve serve from {tree} exited with {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=1).status_code == 200:
                    return time.perf_counter() - t0, psutil.Process(proc.pid).memory_info().rss / 2**20
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
    finally:
        proc.terminate()
        proc.wait(60)


def gateway_import(tree: str) -> tuple[float, float]:
    """Seconds for a fresh interpreter to import the gateway's app from `tree`, and its RSS in
    MiB then (read from /proc: a child's ru_maxrss starts at its parent's on Linux)."""
    code = (
        "import time; t = time.perf_counter(); import kvserve.gateway.app; s = time.perf_counter() - t; "
        "import psutil; print(s, psutil.Process().memory_info().rss / 2**20)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, env={**os.environ, "PYTHONPATH": tree},
        check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    return float(out[0]), float(out[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    add_tree_options(ap)
    args = ap.parse_args()
    trees = compared_trees(ap, args)
    print(run_header())
    from conftest import _save_tiny

    tiny = _save_tiny(tempfile.mkdtemp(prefix="kvserve-tiny-"), "llama")
    cases = {  # each run gives its case's figures, in these names' order
        ("serve, tiny Llama (s)", "  its API process's RSS at ready, tiny (MiB)"): lambda t: serve_ready_s(
            t, tiny, ["--kv-cache-memory", "32MiB"]
        ),
        (
            "serve, default model, make serve's flags (s)",
            "  its API process's RSS at ready, default model (MiB)",
        ): lambda t: serve_ready_s(t, "smollm2-135m", MAKE_SERVE),
        (
            "serve, default model, float32 (serve's own default) (s)",
            "  its API process's RSS at ready, default model float32 (MiB)",
        ): lambda t: serve_ready_s(t, "smollm2-135m", []),
        ("import kvserve.gateway.app (s)", "  its RSS (MiB)"): gateway_import,
    }
    got: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        order = list(trees.items()) if r % 2 == 0 else list(reversed(trees.items()))
        for names, run in cases.items():
            for name, tree in order:
                for case, value in zip(names, run(tree)):
                    got.setdefault((case, name), []).append(value)
        print(
            f"round {r + 1}: "
            + "; ".join(
                f"{c.strip()} {n}: {got[c, n][-1]:.2f}" for names in cases for c in names for n in trees
            )
        )
    print("\nmedians:")
    for case in (c for names in cases for c in names):
        med = {name: statistics.median(got[case, name]) for name in trees}
        line = f"{case}: " + ", ".join(f"{name} {m:.2f}" for name, m in med.items())
        if "baseline" in med:
            line += f"; this / baseline {med['this tree'] / med['baseline']:.2f}x"
        print(line)


if __name__ == "__main__":
    main()
