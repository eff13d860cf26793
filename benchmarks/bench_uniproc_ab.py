"""Single-process engine speed of this checkout against another source tree (e.g. the commit
before the executor layer), same machine, same run: each tree decodes the same workload in
its own subprocess, alternating A B A B ..., best of the rounds for each.

    git archive <base-commit> | tar -x -C /tmp/base
    python benchmarks/bench_uniproc_ab.py --baseline-tree /tmp/base [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

from benchmarks.bench_parallel import cpu_flags  # noqa: E402

WORKLOAD = """
import json, time
from kvserve import LLM, SamplingParams
llm = LLM("smollm2-135m", kv_cache_memory="512MiB")
prompts = [[(i * 31 + 7 * k) % 49152 for i in range(32)] for k in range({batch})]
p = SamplingParams(temperature=0, max_tokens={out}, ignore_eos=True)
llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
llm.llm_engine.reset_prefix_cache()
t0 = time.perf_counter()
outs = llm.generate(prompts, p, use_tqdm=False)
dt = time.perf_counter() - t0
print(json.dumps({{"tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / dt}}))
"""


def one(tree: str, batch: int, out: int) -> float:
    code = WORKLOAD.format(batch=batch, out=out)
    env = {**os.environ, "PYTHONPATH": tree}
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(res.stderr[-2000:])
    return json.loads(res.stdout.strip().splitlines()[-1])["tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline-tree", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=48)
    args = ap.parse_args()
    print(f"# {datetime.date.today()} | CPU flags: {cpu_flags()} | cores: {os.cpu_count()}")
    base, ours = [], []
    for _ in range(args.rounds):
        base.append(one(args.baseline_tree, args.batch, args.output_len))
        ours.append(one(HERE, args.batch, args.output_len))
        print(f"baseline {base[-1]:.1f} tok/s, this tree {ours[-1]:.1f} tok/s")
    b, o = max(base), max(ours)
    print(f"best: baseline {b:.1f} tok/s, this tree {o:.1f} tok/s, ratio {o / b:.3f}")


if __name__ == "__main__":
    main()
