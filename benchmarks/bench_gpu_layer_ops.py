"""Batch-1 decode on a GPU with the layers' small ops as Triton kernels (triton_layer_ops.py)
against the torch ops, in one process, on gpu_check.py's 8B-shaped Llama (random bf16 weights).

For each variant: seconds per token of greedy decode through the engine (a 128-token prompt,
(t(257 tokens) - t(1 token)) / 256, CUDA graphs on) and of one replay of the size-1 decode
graph alone, each against the weight-streaming floor (weight bytes read per token / the
device-to-device copy bandwidth measured in the same run). The variants alternate, twice each.
--smoke runs it on the CPU with tiny shapes (the Triton ops interpreted): it checks the script.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # --smoke: before triton decorates the kernels
import gpu_check  # noqa: E402

import kvserve.model.layers.triton_layer_ops as triton_layer_ops  # noqa: E402


def measure(bench: gpu_check.DecodeBench, triton_ops: bool) -> dict:
    real = triton_layer_ops.TritonLayerOps
    if not triton_ops:  # the model runner then hands the layers None: the torch path
        triton_layer_ops.TritonLayerOps = lambda: None
    try:
        llm = bench.engine()
    finally:
        triton_layer_ops.TritonLayerOps = real
    runner = llm.llm_engine.core.model_runner
    if bench.device == "cpu":  # no model-runner hook without CUDA: hand the layers the ops here
        runner.model.use_layer_ops(real() if triton_ops else None)
    out = {"per_token": gpu_check.decode_seconds_per_token(llm, bench.tokens), "replay": None}
    if runner.graphs is not None:
        out["replay"] = gpu_check.seconds_per_call(runner.graphs.graphs[1][0].replay, 100, bench.device)
    gpu_check._free(bench.device, llm)
    return out


def main() -> int:
    results: dict[str, list[dict]] = {"torch ops": [], "triton ops": []}
    with gpu_check.decode_bench(__doc__.split("\n")[0]) as bench:
        floor = bench.floor
        for _ in range(2):
            for label in results:
                r = measure(bench, label == "triton ops")
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
