"""The native quantized GEMV with its weights coming from memory, not from cache (issue 16).

A single-stream decode reads every weight once per token, so each projection's weights arrive
from DRAM (or a far cache level) when its turn comes. A microbenchmark that repeats one call
on one weight measures the cache instead (bench_quant_native.py). Here each shape is held in
enough copies to pass `--mib` MiB and the calls cycle through them; one row (M = 1), the
engine's threads, best of `--rounds` passes. Each figure is bytes of weights (codes and
scales) per second, beside this run's memory read bandwidth (torch.sum of a 512 MiB array)
and the same call on one hot copy.

    python benchmarks/bench_quant_stream.py [--mib 600] [--rounds 5]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_decode_roofline import read_bandwidth  # noqa: E402
from benchmarks.common import machine, wall_us  # noqa: E402
from benchmarks.cpu_info import cpu_flags  # noqa: E402
from kvserve.model.layers import quant_kernels  # noqa: E402
from kvserve.model.layers.quantization import quantize_weight  # noqa: E402
from kvserve.model.layers.quantized_linear import QuantizedLinear  # noqa: E402

# The default model's projections (int4 layers) and its vocabulary table (int8 in int4 mode).
SHAPES = [
    ("qkv", "int4", 960, 576),
    ("o", "int4", 576, 576),
    ("gate_up", "int4", 3072, 576),
    ("down", "int4", 576, 1536),
    ("lm_head", "int8", 49152, 576),
    ("gate_up", "int8", 3072, 576),
]


def weight_bytes(q: QuantizedLinear) -> int:
    return sum(b.numel() * b.element_size() for b in q.buffers())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=600, help="weights cycled through per shape")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    when = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
    print(f"{machine()}; CPU flags: {cpu_flags()}; native variant {quant_kernels.selected_variant()}; "
          f"{when}; load average {os.getloadavg()}")  # fmt: skip
    bw = read_bandwidth()
    print(f"memory read bandwidth {bw / 1e9:.1f} GB/s")
    print("| shape | format | weight MB | copies | from memory us (GB/s, / bandwidth) | "
          "one hot copy us (GB/s) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, method, n, k in SHAPES:
        first = QuantizedLinear(quantize_weight(torch.randn(n, k), method), "cpu")
        nbytes = weight_bytes(first)
        copies = max(4, args.mib * 2**20 // nbytes)
        layers = [first] + [copy.deepcopy(first) for _ in range(copies - 1)]
        x = torch.randn(1, k)
        for q in layers:
            q(x)
        cold = float("inf")
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for q in layers:
                q(x)
            cold = min(cold, (time.perf_counter() - t0) / copies)
        hot = wall_us(lambda first=first, x=x: first(x), args.rounds * 20) / 1e6
        print(f"| {name} {n}x{k} | {method} | {nbytes / 1e6:.2f} | {copies} | {cold * 1e6:.0f} "
              f"({nbytes / cold / 1e9:.1f}, {nbytes / cold / bw:.0%}) | {hot * 1e6:.0f} "
              f"({nbytes / hot / 1e9:.1f}) |")  # fmt: skip
        del layers
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
