"""What coarser activation scales would cost in perplexity (issue 16: the AMX panels' arithmetic).

The native int4 and int8 kernels quantize each activation row per group of 32 inputs to int8,
one scale a group, so every group's integer sums are stored and scaled on their own
(csrc/quant_matmul_cpu.cpp). Fewer scales a row would let a kernel skip float steps, or sum
several tile multiplies before storing (benchmarks/bench_amx_ceiling.py times those ceilings);
this script measures what each granularity costs in quality. For int4 and int8 weights (as the
engine loads the default model) it scores the shipped corpus with `kvserve.eval.perplexity`:
the native kernels, then the same weights dequantized with activations quantized by a plain
PyTorch simulation (symmetric int8, scale = max |x| / 127, round to nearest) per group of 32
(which should land beside the native kernels' figure: the check of the simulation), 64, 192
and per row, and not at all. Beside an fp32 engine's figure. The simulation replaces the
layers' native call in this process only (QuantizedLinear._native_2d); the gates are the
tests' (tests/test_quant_quality.py): int8 +2%, int4 +10% over fp32.

    python benchmarks/bench_activation_groups.py [--max-tokens 8192] [--formats int4,int8]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine  # noqa: E402
from benchmarks.cpu_info import cpu_flags  # noqa: E402
from kvserve.config import EngineConfig  # noqa: E402
from kvserve.engine.llm_engine import LLMEngine  # noqa: E402
from kvserve.eval.perplexity import load_corpus, perplexity  # noqa: E402
from kvserve.model.layers.quantized_linear import QuantizedLinear  # noqa: E402

GROUPINGS = ["32", "64", "192", "row", "none"]  # inputs a scale; "none": float activations
WINDOW = 384


def fake_quantize(x: torch.Tensor, group: int) -> torch.Tensor:
    """x with each row's groups of `group` inputs quantized to int8 and back."""
    m, k = x.shape
    xg = x.view(m, k // group, group)
    scale = xg.abs().amax(-1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(xg / safe).clamp(-127, 127) * (scale > 0)
    return (codes * scale).view(m, k)


@contextlib.contextmanager
def simulated_activations(grouping: str):
    """Every native quantized projection as float weights (dequantized once) times activations
    quantized per `grouping`, for the duration."""
    native = QuantizedLinear._native_2d
    weights: dict[int, torch.Tensor] = {}

    def run(self: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
        w = weights.get(id(self))
        if w is None:
            w = weights[id(self)] = self.dequantize(torch.float32)
        x = x.float()
        if grouping != "none":
            x = fake_quantize(x, x.shape[1] if grouping == "row" else int(grouping))
        return F.linear(x, w)

    QuantizedLinear._native_2d = run
    try:
        yield
    finally:
        QuantizedLinear._native_2d = native


def score(engine: LLMEngine, ids: list[int]) -> float:
    engine.reset_prefix_cache()  # every position computed under the arithmetic being scored
    return perplexity(engine, ids, WINDOW, progress=False).perplexity


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--formats", default="int4,int8")
    args = ap.parse_args()
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {machine()}")
    print(f"# CPU flags: {cpu_flags()}")
    engine = LLMEngine(EngineConfig(model="smollm2-135m", kv_cache_memory="512MiB"))
    ids = load_corpus(engine, max_tokens=args.max_tokens)
    base = score(engine, ids)
    del engine
    gc.collect()
    print(f"# {len(ids)} tokens of the shipped corpus, windows of {WINDOW}; fp32 perplexity {base:.4f}")
    print("| weights | activations | perplexity | vs fp32 |")
    print("|---|---|---|---|")
    for fmt in args.formats.split(","):
        engine = LLMEngine(EngineConfig(model="smollm2-135m", kv_cache_memory="512MiB", quantization=fmt))
        rows = [("native kernels (per 32)", score(engine, ids))]
        for grouping in GROUPINGS:
            with simulated_activations(grouping):
                label = {"row": "simulated, per row", "none": "float (not quantized)"}.get(grouping)
                rows.append((label or f"simulated, per {grouping}", score(engine, ids)))
        for label, ppl in rows:
            print(f"| {fmt} | {label} | {ppl:.4f} | {100 * (ppl / base - 1):+.2f}% |", flush=True)
        del engine
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
