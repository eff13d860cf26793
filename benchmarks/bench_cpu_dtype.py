"""bf16 vs fp32 projections on this CPU and on an emulated AVX2-only one (issue 16, ISA dispatch).

Why: `--dtype bfloat16` is 2x faster than fp32 where the CPU has avx512_bf16 / AMX and several
times slower where it has not; the engine then computes in fp32 (kvserve/platform/cpu_isa.py).
This script measures the three candidates per projection shape of the default model, in this
process (the real CPU) and in a child process with oneDNN and ATen capped at AVX2
(`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`):
- fp32: the oneDNN-packed fp32 matmul (the default engine),
- bf16: what a bf16 engine runs (kvserve's bf16 panels where the CPU has avx512_bf16 and no
  AMX, else oneDNN-packed bf16 where it packs, else `F.linear`), and oneDNN's packed bf16
  beside it where the panels ran,
- bf16 weights -> fp32: weights kept bf16 in memory, widened per call for the fp32 matmul
  (the "half the memory, fp32 speed" option).
Figures are CPU microseconds per call with one torch thread, the best of `--reps` calls
(benchmarks/common.py `cpu_us`: on a shared machine wall time measures the scheduler);
ratios are against fp32 in the same process.

    python benchmarks/bench_cpu_dtype.py [--reps 30] [--rows 1,32,64,256]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import cpu_us, machine  # noqa: E402
from benchmarks.cpu_info import cpu_flags  # noqa: E402
from kvserve.model.layers.linear import float_kernel_name, linear, onednn_pack, pack_float  # noqa: E402
from kvserve.platform.cpu_isa import cpu_isa  # noqa: E402

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ROWS = "1,32,64,256"  # 64 and more: oneDNN bf16 runs in 32-row runs (model/layers/linear.py)
AVX2_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def one_shape(n: int, k: int, m: int, reps: int) -> dict:
    w = torch.randn(n, k) * 0.05
    w16 = w.bfloat16()
    p32, p16, o16 = onednn_pack(w), pack_float(w16), onednn_pack(w16)
    x = torch.randn(m, k)
    x16 = x.bfloat16()
    panels = p16 is not None and not p16.is_mkldnn and o16 is not None
    return {
        "fp32": cpu_us(lambda: linear(x, w, None, p32), reps),
        "bf16": cpu_us(lambda: linear(x16, w16, None, p16), reps),
        "bf16_kernel": float_kernel_name(torch.bfloat16, p16),
        "bf16_onednn": cpu_us(lambda: linear(x16, w16, None, o16), reps) if panels else None,
        "bf16w_fp32": cpu_us(lambda: F.linear(x, w16.float()), reps),
    }


@torch.inference_mode()
def measure(reps: int, rows: list[int]) -> list[dict]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    return [{"shape": f"{name} {n}x{k}", "M": m, **one_shape(n, k, m, reps)}
            for name, (n, k) in SHAPES.items() for m in rows]  # fmt: skip


def child(reps: int, rows: list[int]) -> dict:
    return {"isa": cpu_isa().describe(), "capability": torch.backends.cpu.get_cpu_capability(),
            "rows": measure(reps, rows)}  # fmt: skip


def table(title: str, res: dict) -> None:
    print(f"\n{title}: flags seen {res['isa']}, ATen capability {res['capability']}")
    print("| shape | M | fp32 packed CPU us | bf16 us (vs fp32), kernel | bf16 oneDNN packed us (vs fp32) "
          "| bf16 weights -> fp32 us (vs fp32) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in res["rows"]:
        f, o = r["fp32"], r["bf16_onednn"]
        onednn = "same as bf16" if o is None else f"{o:.0f} ({o / f:.2f}x)"
        b = r["bf16"]
        print(f"| {r['shape']} | {r['M']} | {f:.0f} | {b:.0f} ({b / f:.2f}x), {r['bf16_kernel']} "
              f"| {onednn} | {r['bf16w_fp32']:.0f} ({r['bf16w_fp32'] / f:.2f}x) |")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rows", default=ROWS, help="row counts (M) to time, comma-separated")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rows = [int(m) for m in args.rows.split(",")]
    if args.child:
        print(json.dumps(child(args.reps, rows)))
        return 0
    native = child(args.reps, rows)
    env = {**os.environ, **AVX2_ENV}
    argv = [sys.executable, __file__, "--child", "--reps", str(args.reps), "--rows", args.rows]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    emulated = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{machine()}; CPU flags: {cpu_flags()}; load average {os.getloadavg()[0]:.2f}")
    table("this CPU", native)
    table("emulated AVX2-only (ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2)", emulated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
