"""Where a batch-1 decode token's time goes on a GPU: gpu_check.py's 8B-shaped Llama (random bf16
weights), the engine with CUDA graphs.

Printed, in ms and as a share of the engine's token, beside the weight-streaming floor (weight
bytes read per token / the device-to-device copy bandwidth measured in the same run):
- the engine's time per token (greedy, a 128-token prompt: (t(257) - t(1)) / 256);
- one replay of the size-1 decode graph alone (the layers), and the lm_head alone;
- what is left, the host's time around them while the GPU waits (scheduling, metadata, the
  graph's buffer copies, sampling, the token's copy back): what overlapping the host's step
  with the GPU's would win;
- from torch.profiler over 32 tokens: the kernels' time a token, split into matrix products
  (cuBLAS / nvjet GEMV and GEMM kernels), attention (the Triton paged kernels) and the rest,
  with the products' bandwidth.
--smoke runs it on the CPU with tiny shapes (no graphs, no CUDA profile): it checks the script.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_check  # noqa: E402


def _kernel_split(llm, prompt: list[int], tokens: int) -> dict[str, float]:
    """Kernel seconds a token by kind, from torch.profiler over `tokens` decode tokens."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt], gpu_check._greedy(tokens + 1), use_tqdm=False)
    split = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for e in prof.key_averages():
        name, us = e.key.lower(), e.self_device_time_total
        if "gemm" in name or "gemv" in name or "nvjet" in name or "cutlass" in name:
            split["matmul"] += us
        elif "paged" in name or "decode_reduce" in name or "kv_write" in name:
            split["attention"] += us
        else:
            split["other"] += us
    return {k: v / 1e6 / (tokens + 1) for k, v in split.items()}


def main() -> int:
    with gpu_check.decode_bench(__doc__.split("\n")[0]) as bench:
        device, floor = bench.device, bench.floor
        llm = bench.engine()
        runner = llm.llm_engine.core.model_runner
        per_token = gpu_check.decode_seconds_per_token(llm, bench.tokens)
        hidden = torch.randn(1, bench.shape["hidden_size"], dtype=runner.dtype, device=device)
        lm_head = gpu_check.seconds_per_call(lambda: runner.model.compute_logits(hidden), 50, device)
        replay = None
        if runner.graphs is not None:
            replay = gpu_check.seconds_per_call(runner.graphs.graphs[1][0].replay, 100, device)

        def line(label: str, seconds: float) -> None:
            share = seconds / per_token
            print(f"{label:<34} {seconds * 1e3:8.3f} ms   {share:6.1%} of the token", flush=True)

        line("engine, a token", per_token)
        if replay is not None:
            line("graph replay (the layers)", replay)
        line("lm_head (one row)", lm_head)
        if replay is not None:
            line("host around them (GPU waiting)", per_token - replay - lm_head)
        line("floor (weights at copy bandwidth)", floor)
        print(f"roofline fraction {floor / per_token:.3f} (target 0.8)", flush=True)
        if device == "cuda":
            split = _kernel_split(llm, gpu_check.DECODE_PROMPT, 32)
            for kind, seconds in split.items():
                line(f"kernels: {kind}", seconds)
            # every weight byte goes through a matrix product: their time against the floor's
            print(f"matrix products stream the weights at {floor / split['matmul']:.2f} of copy bandwidth")
        gpu_check._free(device, llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
