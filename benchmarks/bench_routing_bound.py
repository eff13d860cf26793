"""The best hit-rate ratio any router can show on bench_data_parallel.py's workload (issue 14).

Issue 14 asks cache-aware routing for a prefix-cache hit rate >= 1.8x round-robin's. How
high that ratio can go depends on the pool size, not only on the router: a pool that holds
every tenant gives round-robin nearly every hit too, one that holds too few gives no router
any. This replays bench_data_parallel.py's own request sequence (`workload`, same seed: which
tenant each request is) through two replicas whose KV pools are LRU queues as the engine's
block pool is (a request's blocks freed tail first, hits taken out of the queue), one request
at a time, for two routers:
- round-robin: request i to replica i % 2;
- split: tenant t always to replica t % 2, so each replica serves 4 of the 8 tenants (what a
  perfect cache-aware router converges to on uniform tenants).
Hit rate is cached prompt tokens / prompt tokens, as the server counts it. Prints both and
their ratio per pool size (blocks, and MiB at the default model's 720 KiB fp32 block), and
the ratio no router can pass whatever the pool: every request but each tenant's first hitting
its whole prefix, over round-robin's hit rate.

    python benchmarks/bench_routing_bound.py [--blocks 240:348:12] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import OrderedDict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_data_parallel import workload  # noqa: E402

BLOCK = 16
BLOCK_KIB = 30 * 2 * 3 * 64 * 4 * BLOCK // 1024  # layers x (K, V) x kv heads x head_dim x fp32


def replay(tenants: list[int], blocks: int, route, shared: int, private: int, prompt: int) -> float:
    """Hit rate over the sequence with `blocks` per replica; route(i, tenant) -> replica."""
    pools: list[OrderedDict] = [OrderedDict(), OrderedDict()]  # block key -> None, LRU first
    hit = 0
    for i, t in enumerate(tenants):
        pool = pools[route(i, t)]
        keys = [("tenant", t, j) for j in range(shared)] + [("request", i, j) for j in range(private)]
        n = 0
        while n < len(keys) and keys[n] in pool:  # a prefix hit stops at the first missing block
            n += 1
        hit += min(n * BLOCK, prompt - 1)
        for k in keys[:n]:
            del pool[k]  # in use: out of the free queue
        while len(pool) > blocks - len(keys):
            pool.popitem(last=False)  # evict the least recently freed
        for k in reversed(keys):  # freed tail first, so the tail is evicted first
            pool[k] = None
    return hit / (prompt * len(tenants))


def round_robin(i: int, tenant: int) -> int:
    return i % 2


def split(i: int, tenant: int) -> int:
    return tenant % 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", default="240:348:12", help="start:stop:step of blocks per replica")
    ap.add_argument("--seeds", default="0", help="bench_data_parallel.py --seed values to replay, e.g. 0,1,2")
    ap.add_argument("--shared-blocks", type=int, default=63, help="a 1,010-token system prompt")
    ap.add_argument("--private-blocks", type=int, default=5, help="question + 16 outputs past the prefix")
    ap.add_argument("--prompt-tokens", type=int, default=1063)
    args = ap.parse_args()
    a, b, step = (int(x) for x in args.blocks.split(":"))
    print(f"256 requests over 8 tenants; {args.shared_blocks} shared + {args.private_blocks} private blocks "
          "a request; LRU pools, one request at a time")  # fmt: skip
    print("| seed | blocks per replica | MiB | round-robin hit rate | split hit rate | split / round-robin "
          "| any router's ceiling / round-robin |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for seed in (int(x) for x in args.seeds.split(",")):
        w = argparse.Namespace(seed=seed, tenants=8, system_tokens=1000, question_tokens=50, requests=256,
                               rate=1.0, skew=None)  # fmt: skip
        tenants = [tenant for _, tenant, _ in workload(w)]  # the rate changes arrival times, not tenants
        # No router does better than every request but each tenant's first hitting its whole prefix.
        ceiling = (
            (len(tenants) - len(set(tenants)))
            * args.shared_blocks
            * BLOCK
            / (len(tenants) * args.prompt_tokens)
        )
        for blocks in range(a, b, step):
            shape = (args.shared_blocks, args.private_blocks, args.prompt_tokens)
            r, s = (replay(tenants, blocks, route, *shape) for route in (round_robin, split))
            mib = blocks * BLOCK_KIB / 1024
            print(
                f"| {seed} | {blocks} | {mib:.0f} | {r:.3f} | {s:.3f} | {s / r:.2f}x | {ceiling / r:.2f}x |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
