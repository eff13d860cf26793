"""The native matmuls' activation quantizer (csrc/quant_matmul_cpu.cpp `quantize_rows_into`)
on its own: per row and group of 32 inputs, int8 codes, the scale and the code sum, as every
int4 / int8 projection does before its panels (issue 16: 2-4% of a batched int4 decode step).

Times one call (one thread, as each OpenMP thread quantizes its share of the rows) for the
default model's activation widths (576: attention and MLP inputs; 1536: the down projection)
at 1, 64 and 96 rows, for each SIMD variant this CPU runs, and with --baseline REV for the
selected variant built from git revision REV, the builds alternating --rounds times (best of
each), with each variant's time over the first one's.

    python benchmarks/bench_activation_quant.py [--baseline REV] [--rounds 5] [--reps 300]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine, wall_us  # noqa: E402
from benchmarks.cpu_info import cpu_flags  # noqa: E402
from kvserve.model.layers import quant_kernels as qk  # noqa: E402

QUANTIZE = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 4)


def variant_at(rev: str, variant: str):
    """`variant` of the quantized-matmul module built from the source as of git revision `rev`."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rel = os.path.relpath(qk.SRC, root)
    source = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=root, capture_output=True, check=True).stdout
    path = os.path.join(tempfile.mkdtemp(prefix="kvserve-quant-"), os.path.basename(qk.SRC))
    with open(path, "wb") as f:
        f.write(source)
    return qk.build_extension(qk.build_name(variant, source), [path], qk.VARIANTS[variant])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", help="a git revision whose quantizer (the selected variant) to time too")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args()
    if qk.load_quant_kernels("generic") is None:
        print("C++ toolchain unavailable")
        return 1
    print(f"{machine()}; CPU flags: {cpu_flags()}; load average {os.getloadavg()}")
    builds = {v: qk.load_quant_kernels(v) for v in qk.runnable_variants() if v != "generic"}
    if args.baseline:
        selected = qk.selected_variant()
        builds[f"{selected} at {args.baseline}"] = variant_at(args.baseline, selected)
    fns = {name: QUANTIZE(mod.matmul_addresses()["quantize_rows"]) for name, mod in builds.items()}
    torch.manual_seed(0)
    first = next(iter(fns))
    for k in (576, 1536):
        for m in (1, 64, 96):
            x = torch.randn(m, k)
            out = [torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // 32), torch.empty(m, k // 32),
                   torch.empty(m, k // 32, dtype=torch.int32)]  # fmt: skip
            ptrs = (x.data_ptr(), m, k, *(t.data_ptr() for t in out))
            best = dict.fromkeys(fns, float("inf"))
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    best[name] = min(best[name], wall_us(lambda fn=fn, ptrs=ptrs: fn(*ptrs), args.reps))
            cells = [f"{name} {us:.2f} us ({us / best[first]:.2f}x)" for name, us in best.items()]
            print(f"{m} rows x {k}: " + "; ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
