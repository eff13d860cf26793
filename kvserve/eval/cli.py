"""`kvserve eval perplexity MODEL`: argument parsing and printing, nothing else."""

from __future__ import annotations

import argparse
import json
import sys

from kvserve.argtypes import at_most, int_at_least


def cmd_perplexity(args: argparse.Namespace) -> int:
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.entrypoints.cli import engine_config
    from kvserve.eval.perplexity import CORPUS, load_corpus, perplexity

    try:
        engine = LLMEngine(engine_config(args))
        ids = load_corpus(engine, args.corpus or CORPUS, args.max_tokens)
        res = perplexity(engine, ids, args.window, progress=not args.no_progress)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = engine.core.config  # as run: bfloat16 on a CPU without native bf16 computed in float32
    kv_dtype = cfg.dtype if cfg.kv_cache_dtype == "auto" else cfg.kv_cache_dtype  # "auto": the compute dtype
    print(
        f"model {args.model}  dtype {cfg.dtype}  quantization {cfg.quantization or 'none'}  "
        f"kv-cache {kv_dtype}"
    )
    cut = f" (--window {args.window} is more than the model holds)" if res.window < args.window else ""
    print(
        f"perplexity {res.perplexity:.4f}  ({res.num_tokens} tokens scored in {res.num_windows} windows "
        f"of {res.window}{cut}, {res.tokens_per_s:.1f} tokens/s)"
    )
    if args.json:  # the window and corpus too: a perplexity means little without them
        row = {"model": args.model, "dtype": cfg.dtype, "quantization": cfg.quantization,
               "kv_cache_dtype": kv_dtype, "perplexity": res.perplexity, "nll": res.nll,
               "tokens": res.num_tokens, "windows": res.num_windows, "window": res.window,
               "corpus": args.corpus or "persuasion_ch1-8 (shipped)", "seconds": res.seconds}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(row, f, indent=2)
    return 0


# tokens: the first of a window is not scored (checked before the model loads); a 20-digit
# value was taken and run as "the whole corpus" or cut to the model's length unsaid
_AT_LEAST_TWO = int_at_least(2)
_WINDOW = at_most(_AT_LEAST_TWO, 10**7, "past any model's context")
_MAX_TOKENS = at_most(_AT_LEAST_TWO, 10**9, "past any corpus's length")


def _corpus(text: str) -> str:
    """A UTF-8 text file with some text in it: an empty one was found only after the model had
    loaded, as "token_ids: need at least 2 tokens to score"."""
    from kvserve.argtypes import utf8_text_file

    utf8_text_file(text)
    with open(text, encoding="utf-8-sig") as f:  # a byte-order mark alone is no text either
        if not any(line.strip() for line in f):
            raise argparse.ArgumentTypeError(f"{text!r}: no text to score (the file is empty or blank)")
    return text


def register(sub) -> None:
    from kvserve.argtypes import writable_file
    from kvserve.entrypoints.cli import add_engine_args

    ev = sub.add_parser("eval", help="quality evaluation through the engine")
    evsub = ev.add_subparsers(dest="eval_command", required=True)
    p = evsub.add_parser(
        "perplexity",
        help="perplexity on the shipped English corpus (Persuasion, ch. 1-8) via prompt logprobs",
    )
    p.add_argument("model", nargs="?", default="smollm2-135m", help="alias, .gguf file or HF directory")
    p.add_argument(
        "--corpus", type=_corpus, default=None, help="a UTF-8 text file instead of the shipped corpus"
    )
    p.add_argument(
        "--max-tokens", type=_MAX_TOKENS, default=None, help="score only the first N corpus tokens (>= 2)"
    )
    p.add_argument(
        "--window", type=_WINDOW, default=1024, help="tokens per scored window (non-overlapping, >= 2)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", type=writable_file, default=None, help="also write the result to this JSON file")
    add_engine_args(p)
    p.set_defaults(func=cmd_perplexity)
