"""GGUF metadata parse at engine start: gguf's own reader against kvserve's plain-view reader
(kvserve/model/loader/gguf_file.py), on the default model's file. Every server start parses it
twice (the API process for the tokenizer, the engine core for everything), every offline LLM
once. Times are this thread's CPU seconds (load on a shared host does not count), alternating
the two readers for --rounds rounds; the ratio is of the medians.

    python benchmarks/bench_gguf_parse.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import run_header  # noqa: E402


def _parse_s(cls, path: str) -> float:
    t0 = time.thread_time()
    reader = cls(path)
    spent = time.thread_time() - t0
    assert reader.tensors
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import gguf

    from kvserve.model.loader import gguf_file, resolve_model

    path = resolve_model("smollm2-135m").path
    print(run_header())
    print(f"file: {os.path.basename(path)}, {os.path.getsize(path) / 2**20:.0f} MiB")
    theirs, ours = [], []
    for _ in range(args.rounds):
        theirs.append(_parse_s(gguf.GGUFReader, path))
        ours.append(_parse_s(gguf_file._reader_class(), path))
    for name, xs in (("gguf.GGUFReader", theirs), ("plain-view reader", ours)):
        print(f"{name:18s} CPU s: median {statistics.median(xs):.2f}, best {min(xs):.2f}, all "
              + " ".join(f"{x:.2f}" for x in xs))  # fmt: skip
    print(f"plain-view / gguf (medians): {statistics.median(ours) / statistics.median(theirs):.3f}x")


if __name__ == "__main__":
    main()
