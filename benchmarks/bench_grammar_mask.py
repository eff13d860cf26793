"""Per-step cost of the grammar mask: fill + apply for N constrained rows (default 32) of the
default model's vocabulary, with N varied JSON schemas compiled and each matcher inside its
object. Compare with the step time at the same batch size (docs/BENCHMARKS.md).

    python benchmarks/bench_grammar_mask.py [--rows 32] [--iters 50]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kvserve.bench.json_schemas import varied_schemas  # noqa: E402
from kvserve.model.loader import load_tokenizer, resolve_model  # noqa: E402
from kvserve.structured.backend import GrammarCompiler  # noqa: E402
from kvserve.structured.bitmask import apply_grammar_bitmask  # noqa: E402
from kvserve.structured.state import GrammarState  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    tok = load_tokenizer(resolve_model("smollm2-135m"))
    vocab = tok.vocab_size
    compiler = GrammarCompiler(lambda: tok, vocab, [tok.eos_token_id])
    reqs = []
    for s in varied_schemas(args.rows, 0):
        state = GrammarState(compiler.submit(("json", json.dumps(s))).result())
        state.accept_tokens(tok.encode("{", add_special_tokens=False))
        reqs.append(SimpleNamespace(grammar=state))
    logits = torch.randn(args.rows, vocab)
    apply_grammar_bitmask(logits, reqs)  # warm-up: allocates the bitmask
    t0 = time.perf_counter()
    for _ in range(args.iters):
        apply_grammar_bitmask(logits, reqs)
    ms = (time.perf_counter() - t0) / args.iters * 1000
    print(f"fill + apply, {args.rows} JSON rows x {vocab} vocab: {ms:.2f} ms per step ({torch.__version__})")


if __name__ == "__main__":
    main()
