"""What a float32 engine's load of a GGUF spends turning its blocks into floats: gguf's numpy
dequantizer (plus the writable copy the loader made of it) against kvserve's torch one
(kvserve/model/loader/gguf_dequant.py, the same bits), over every tensor of the default model
(or `--model`), the two alternating for `--rounds` rounds in one process. Prints each round's
seconds, the medians and their ratio, with the CPU flags and the load average.

    python benchmarks/bench_gguf_dequant.py [--rounds 5] [--model FILE.gguf]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from benchmarks.common import run_header  # noqa: E402
from kvserve.model.loader.gguf_dequant import dequantize  # noqa: E402
from kvserve.model.loader.gguf_file import gguf_reader  # noqa: E402
from kvserve.model.loader.resolve import default_model_file  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded default model)")
    args = ap.parse_args()
    print(run_header())
    tensors = list(gguf_reader(args.model or default_model_file()).tensors)
    kinds = sorted({t.tensor_type.name for t in tensors})
    print(f"{len(tensors)} tensors ({', '.join(kinds)}), torch threads {torch.get_num_threads()}")
    ways = {
        "gguf numpy": lambda t: torch.from_numpy(
            np.array(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32)
        ),
        "kvserve torch": lambda t: dequantize(t.data, t.tensor_type),
    }
    got: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(args.rounds):
        for name in ways if r % 2 == 0 else reversed(ways):
            t0 = time.perf_counter()
            for t in tensors:
                ways[name](t)
            got[name].append(time.perf_counter() - t0)
        print(f"round {r + 1}: " + ", ".join(f"{n} {s[-1]:.3f} s" for n, s in got.items()))
    med = {n: statistics.median(s) for n, s in got.items()}
    print("medians: " + ", ".join(f"{n} {m:.3f} s" for n, m in med.items()))
    print(f"kvserve torch / gguf numpy: {med['kvserve torch'] / med['gguf numpy']:.2f}x")


if __name__ == "__main__":
    main()
