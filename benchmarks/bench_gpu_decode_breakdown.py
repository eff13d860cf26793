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

import argparse
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_check  # noqa: E402


def _timed(fn, repeats: int, device: str) -> float:
    """Seconds per call of fn, after one warm-up call."""
    fn()
    gpu_check._sync(device)
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    gpu_check._sync(device)
    return (time.perf_counter() - t) / repeats


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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script only")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke to check the script on the CPU", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (smoke)'}, "
          f"torch {torch.__version__}", flush=True)  # fmt: skip
    shape, tokens = (gpu_check.TINY, 16) if args.smoke else (gpu_check.LLAMA_8B, 256)
    with tempfile.TemporaryDirectory() as tmp:
        wdtype = torch.float32 if args.smoke else torch.bfloat16
        path, read = gpu_check.build_llama(os.path.join(tmp, "m"), shape, wdtype, device)
        bw = gpu_check.copy_bandwidth(device, (64 << 20) if args.smoke else (4 << 30))
        floor = read / bw
        lm_head_bytes = shape["vocab_size"] * shape["hidden_size"] * wdtype.itemsize
        print(f"weights read per token {read / 1e9:.2f} GB (lm_head {lm_head_bytes / 1e9:.2f}), copy "
              f"bandwidth {bw / 1e9:.0f} GB/s, floor {floor * 1e3:.3f} ms/token", flush=True)  # fmt: skip
        kv = "8GiB" if device == "cuda" else "64MiB"
        llm = gpu_check._llm(path, device, dtype=str(wdtype).removeprefix("torch."), max_model_len=1024,
                             max_num_seqs=8, kv_cache_memory=kv)  # fmt: skip
        runner = llm.llm_engine.core.model_runner
        prompt = [random.Random(0).randrange(3, 500) for _ in range(128)]
        llm.generate([prompt], gpu_check._greedy(8), use_tqdm=False)  # warm-up
        times = {}
        for n in (1, tokens + 1):
            t = time.perf_counter()
            llm.generate([prompt], gpu_check._greedy(n), use_tqdm=False)
            times[n] = time.perf_counter() - t
        per_token = (times[tokens + 1] - times[1]) / tokens
        hidden = torch.randn(1, shape["hidden_size"], dtype=runner.dtype, device=device)
        lm_head = _timed(lambda: runner.model.compute_logits(hidden), 50, device)
        replay = None
        if runner.graphs is not None:
            replay = _timed(runner.graphs.graphs[1][0].replay, 100, device)

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
            split = _kernel_split(llm, prompt, 32)
            for kind, seconds in split.items():
                line(f"kernels: {kind}", seconds)
            print(f"matrix products at {read / split['matmul'] / 1e9:.0f} GB/s "
                  f"({read / split['matmul'] / bw:.2f} of the copy bandwidth)")  # fmt: skip
        gpu_check._free(device, llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
