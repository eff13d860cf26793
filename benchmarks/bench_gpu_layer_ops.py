"""Batch-1 decode on a GPU with the layers' small ops as Triton kernels (triton_layer_ops.py)
against the torch ops, in one process, on gpu_check.py's 8B-shaped Llama (random bf16 weights).

For each variant: seconds per token of greedy decode through the engine (a 128-token prompt,
(t(257 tokens) - t(1 token)) / 256, CUDA graphs on) and of one replay of the size-1 decode
graph alone, each against the weight-streaming floor (weight bytes read per token / the
device-to-device copy bandwidth measured in the same run). The variants alternate, twice each.
--smoke runs it on the CPU with tiny shapes (the Triton ops interpreted): it checks the script.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # --smoke: before triton decorates the kernels
import gpu_check  # noqa: E402

import kvserve.model.layers.triton_layer_ops as triton_layer_ops  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(path: str, device: str, triton_ops: bool, tokens: int) -> dict:
    real = triton_layer_ops.TritonLayerOps
    if not triton_ops:  # the model runner then hands the layers None: the torch path
        triton_layer_ops.TritonLayerOps = lambda: None
    try:
        llm = gpu_check._llm(path, device, dtype="bfloat16" if device == "cuda" else "float32",
                             max_model_len=1024, max_num_seqs=8,
                             kv_cache_memory="8GiB" if device == "cuda" else "64MiB")  # fmt: skip
    finally:
        triton_layer_ops.TritonLayerOps = real
    runner = llm.llm_engine.core.model_runner
    if device == "cpu":  # no model-runner hook without CUDA: hand the layers the ops here
        runner.model.use_layer_ops(real() if triton_ops else None)
    prompt = [random.Random(0).randrange(3, 500) for _ in range(128)]
    llm.generate([prompt], gpu_check._greedy(8), use_tqdm=False)  # warm-up
    times = {}
    for n in (1, tokens + 1):
        t = time.perf_counter()
        llm.generate([prompt], gpu_check._greedy(n), use_tqdm=False)
        times[n] = time.perf_counter() - t
    out = {"per_token": (times[tokens + 1] - times[1]) / tokens, "replay": None}
    if runner.graphs is not None:
        graph = runner.graphs.graphs[1][0]
        graph.replay()
        _sync()
        t = time.perf_counter()
        for _ in range(100):
            graph.replay()
        _sync()
        out["replay"] = (time.perf_counter() - t) / 100
    gpu_check._free(device, llm)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script only")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke to check the script on the CPU", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)"
    print(f"device: {name}, torch {torch.__version__}", flush=True)
    shape, tokens = (gpu_check.TINY, 16) if args.smoke else (gpu_check.LLAMA_8B, 256)
    with tempfile.TemporaryDirectory() as tmp:
        wdtype = torch.float32 if args.smoke else torch.bfloat16
        path, read = gpu_check.build_llama(os.path.join(tmp, "m"), shape, wdtype, device)
        bw = gpu_check.copy_bandwidth(device, (64 << 20) if args.smoke else (4 << 30))
        floor = read / bw
        print(f"weights read per token {read / 1e9:.2f} GB, copy bandwidth {bw / 1e9:.0f} GB/s, "
              f"floor {floor * 1e3:.3f} ms/token", flush=True)  # fmt: skip
        results: dict[str, list[dict]] = {"torch ops": [], "triton ops": []}
        for _ in range(2):
            for label in results:
                r = measure(path, device, label == "triton ops", tokens)
                results[label].append(r)
                replay = ""
                if r["replay"] is not None:
                    replay = (
                        f", graph replay {r['replay'] * 1e3:.3f} ms ({floor / r['replay']:.3f} of the floor)"
                    )
                print(f"{label}: {r['per_token'] * 1e3:.3f} ms/token ({floor / r['per_token']:.3f} of the "
                      f"floor){replay}", flush=True)  # fmt: skip
    best = {k: min(r["per_token"] for r in v) for k, v in results.items()}
    print(f"per token, triton ops / torch ops: {best['triton ops'] / best['torch ops']:.3f} (best of 2 "
          f"each); roofline fraction {floor / best['triton ops']:.3f} (target 0.8)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
