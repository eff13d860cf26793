"""The CPU paged decode attention kernel (csrc/paged_attention_cpu.cpp) on its own.

One call as a decode step makes it: --seqs sequences (32: a c=32 step) of --context tokens,
the default model's heads (9 query, 3 kv, head_dim 64), block tables scattered over a pool far
larger than the caches, fp32 and int8 caches, each with the pool in ordinary 4 KiB pages and
in transparent huge pages as the engine allocates it (platform/huge_pages.py, where the OS
grants them). Prints ms per call (best of --reps, the engine's two threads) and the KV bytes
it reads per second, beside the machine's read bandwidth measured in the same run.

With --chunk N the call also carries a prompt chunk's N rows after the sequences (row i
attending to i + 1 tokens), as a served step with a prompt arriving does: rows of very
different lengths, the long ones first.

With --baseline REV the kernels as of git revision REV are built too and each case alternates
between the two builds (--rounds times, best of each), so a shared machine's drift falls on
both alike; the ratio printed is this tree's time over the baseline's.

    python benchmarks/bench_paged_attention.py [--seqs 32] [--context 164] [--chunk 0] [--reps 50]
        [--baseline REV]
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_decode_roofline import read_bandwidth  # noqa: E402
from benchmarks.common import machine, wall_us  # noqa: E402
from benchmarks.cpu_info import cpu_flags  # noqa: E402
from kvserve.model.layers import cpu_kernels  # noqa: E402
from kvserve.platform.huge_pages import huge_page_full  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of t in transparent huge pages, as the engine's KV pool is allocated."""
    return huge_page_full(tuple(t.shape), 0, t.dtype).copy_(t)


def huge_kib() -> int:
    """AnonHugePages of this process (0 where the OS gave none)."""
    with open("/proc/self/smaps_rollup") as f:
        return next((int(line.split()[1]) for line in f if line.startswith("AnonHugePages")), 0)


def kernels_at(rev: str):
    """The CPU kernels extension built from the C++ sources as of git revision `rev`."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folder = tempfile.mkdtemp(prefix="kvserve-csrc-")
    paths, source = [], b""
    for path in cpu_kernels.SOURCES + cpu_kernels.HEADERS:
        rel = os.path.relpath(path, root)
        shown = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=root, capture_output=True, check=True)
        paths.append(os.path.join(folder, os.path.basename(path)))
        source += shown.stdout  # what the build name hashes, in read_sources' order
        with open(paths[-1], "wb") as f:
            f.write(shown.stdout)
    n = len(cpu_kernels.SOURCES)
    name = cpu_kernels._build_name(source)
    return cpu_kernels.build_extension(name, paths[:n], cpu_kernels._CFLAGS, paths[n:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--context", type=int, default=164)
    ap.add_argument("--chunk", type=int, default=0, help="rows of a prompt chunk after the sequences")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--pool-blocks", type=int, default=6000)
    ap.add_argument("--baseline", help="a git revision whose kernels to time against, alternating")
    ap.add_argument("--rounds", type=int, default=3, help="alternations with --baseline")
    args = ap.parse_args()
    kernels = cpu_kernels.load_cpu_kernels()
    if kernels is None:
        print("C++ kernels unavailable")
        return 1
    builds = {"this tree": kernels}
    if args.baseline:
        builds[args.baseline] = kernels_at(args.baseline)
    torch.manual_seed(0)
    torch.set_num_threads(2)
    print(f"{machine()}; CPU flags: {cpu_flags()}; load average {os.getloadavg()}")
    per_seq = -(-args.context // BLOCK)
    # Disjoint block tables, one per call in turn: the model's 30 layers each read their own
    # cache once a step, so a call finds its blocks in memory, not in a cache level.
    sets = args.pool_blocks // (args.seqs * per_seq)
    perm = torch.randperm(args.pool_blocks)[: sets * args.seqs * per_seq].long()
    tables_of = [t.view(args.seqs, per_seq) for t in perm.chunk(sets)]
    turn = [0]

    def tables() -> torch.Tensor:
        turn[0] += 1
        t = tables_of[turn[0] % sets]
        return torch.cat([t, t[:1].expand(args.chunk, -1)]) if args.chunk else t  # the chunk: one table

    lens = torch.cat([torch.full((args.seqs,), args.context), torch.arange(1, args.chunk + 1)]).long()
    q = torch.randn(args.seqs + args.chunk, HEADS, HEAD_DIM)
    shape = (args.pool_blocks, KV_HEADS, BLOCK, HEAD_DIM)
    k32, v32 = torch.randn(shape), torch.randn(shape)
    k8, v8 = ((t * 30).clamp(-127, 127).to(torch.int8) for t in (k32, v32))
    scales = torch.full(shape[:3], 1 / 30).bfloat16()
    none = torch.empty(0, dtype=torch.bfloat16)
    plain = {"fp32": (k32, v32, none), "int8": (k8, v8, scales)}
    pools = {"4 KiB pages": plain, "huge pages": {n: tuple(map(in_huge_pages, c)) for n, c in plain.items()}}
    bw = read_bandwidth()
    print(
        f"read bandwidth {bw / 1e9:.1f} GB/s; {args.seqs} sequences x {args.context} tokens"
        f"{f' and a {args.chunk}-row prompt chunk' if args.chunk else ''}; "
        f"calls rotate over {sets} disjoint sets of blocks"
    )
    kv_bytes = int(lens.sum()) * KV_HEADS * HEAD_DIM * 2

    def decode(module, k: torch.Tensor, v: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return module.paged_decode_attention(q, k, v, scales, scales, tables(), lens, 0.125)

    for pages, caches in pools.items():
        for name, (k, v, s) in caches.items():
            best = dict.fromkeys(builds, float("inf"))
            for _ in range(args.rounds if len(builds) > 1 else 1):
                for build, module in builds.items():
                    us = wall_us(functools.partial(decode, module, k, v, s), args.reps)
                    best[build] = min(best[build], us)
            cells = []
            for build, us in best.items():
                rate = kv_bytes * k.element_size() / us / 1e3
                cells.append(
                    f"{build}: {us / 1e3:.3f} ms per call, KV read at {rate:.1f} GB/s ({rate * 1e9 / bw:.0%})"
                )
            if args.baseline:
                cells.append(f"this tree / {args.baseline} {best['this tree'] / best[args.baseline]:.2f}x")
            print(f"{name} cache, {pages}: " + "; ".join(cells))
    print(f"huge pages held by this process: {huge_kib()} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
