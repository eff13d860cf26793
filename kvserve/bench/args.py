"""Command-line options of `kvserve bench`, kept apart so building the parser imports nothing heavy."""

from __future__ import annotations

import argparse
import math
from urllib.parse import urlsplit

from kvserve.argtypes import (
    at_most,
    json_object,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    rate,
)
from kvserve.bench.datasets import DATASETS
from kvserve.bench.slo import parse_slo
from kvserve.bench.vllm_args import endpoint

# Past these a value is a typo of digits: 1e14 prompts were built for minutes on end (the run
# never started), a 20-digit length was an OverflowError traceback
NUM_PROMPTS = at_most(positive_int, 10**6, "a million requests a run")
LENGTH = at_most(positive_int, 10**7, "past any model's context")
PREFIX_LENGTH = at_most(non_negative_int, 10**7, "past any model's context")


def range_ratio(text: str) -> float:
    """In [0, 1): at 1 or more the lower bound len*(1-r) is 0 or below and was raised to 1, so
    lengths were no longer spread around len (most prompts 1 token at r=3)."""
    value = non_negative_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be < 1 (lengths spread over len*(1±r)), got {value:g}")
    return value


def slo(text: str) -> str:
    """Checked as it is parsed (slo.parse_slo), so a typo stops the command before the
    tokenizer loads and the prompts are built."""
    try:
        parse_slo(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("slo: ")) from None
    return text


def base_url(text: str) -> str:
    """An http(s) URL with a host: "localhost:8000" was taken, and the run then failed every
    request with aiohttp's NonHttpUrlClientError and printed a report of dashes."""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        hint = f" (did you mean 'http://{text}'?)" if "://" not in text else ""
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL{hint}")
    return text


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", choices=DATASETS, default="random")
    g.add_argument("--dataset-path", default=None,
                   help="jsonl: a JSONL file; trace: a JSONL trace or bursty:... spec")  # fmt: skip
    g.add_argument(
        "--tokenizer", default=None,
        help="alias, .gguf or HF directory (default: --model, or the served model's root)",
    )  # fmt: skip
    g.add_argument("--num-prompts", type=NUM_PROMPTS, default=100)
    g.add_argument("--input-len", type=LENGTH, default=128, help="prompt tokens (chat: the median)")
    g.add_argument("--output-len", type=LENGTH, default=128, help="max_tokens (chat: the median)")
    g.add_argument("--range-ratio", type=range_ratio, default=0.0, help="random/prefix lengths in len*(1±r)")
    g.add_argument(
        "--prefix-len", type=PREFIX_LENGTH, default=256, help="prefix dataset: shared prefix tokens"
    )
    g.add_argument(
        "--num-prefix-groups", type=positive_int, default=4, help="prefix dataset: distinct prefixes"
    )
    g.add_argument("--seed", type=int, default=0)
    # vLLM's spellings of the same options (its random dataset's), each error naming the flag given
    for flag, dest, typ in (
        ("--dataset-name", "dataset", None), ("--random-input-len", "input_len", LENGTH),
        ("--random-output-len", "output_len", LENGTH), ("--random-range-ratio", "range_ratio", range_ratio),
    ):  # fmt: skip
        choices = DATASETS if dest == "dataset" else None
        same = "= --" + dest.replace("_", "-")
        g.add_argument(flag, dest=dest, type=typ, choices=choices, default=argparse.SUPPRESS, help=same)


def add_serve_args(p: argparse.ArgumentParser, single_url: bool = True) -> None:
    if single_url:
        p.add_argument(
            "--base-url", type=base_url, default=None, help="server root (or .../v1); http://127.0.0.1:8000"
        )
    p.add_argument(
        "--model",
        default=None,
        help="model name sent in requests (default: the one the server's /v1/models lists)",
    )
    p.add_argument("--endpoint", type=endpoint, default="completions",
                   help="completions or chat (or vLLM's /v1/completions, /v1/chat/completions)")  # fmt: skip
    p.add_argument("--prompt-format", choices=("text", "ids"), default="text",
                   help="completions prompt as text or token ids")  # fmt: skip
    p.add_argument("--api-key", default=None)
    p.add_argument("--ignore-eos", action="store_true", help="fixed output lengths (server extension)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0)
    p.add_argument("--extra-body", type=json_object, default=None, help="JSON merged into every request body")
    p.add_argument("--request-rate", type=rate, default=math.inf, help="requests/s (inf: all at once)")
    p.add_argument(
        "--burstiness", type=positive_float, default=1.0, help="gamma shape of arrivals (1: Poisson)"
    )
    p.add_argument("--max-concurrency", type=positive_int, default=None)
    p.add_argument("--warmup", type=non_negative_int, default=0, help="untimed requests sent first")
    p.add_argument("--slo", type=slo, default=None, help="goodput SLOs in ms, e.g. ttft:500,tpot:50")
    p.add_argument("--disable-tqdm", action="store_true")
    add_dataset_args(p)


def add_offline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or HF directory")
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--max-num-seqs", type=positive_int, default=None)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--ignore-eos", action="store_true", help="fixed output lengths")
    p.add_argument("--temperature", type=non_negative_float, default=0.0)
    add_dataset_args(p)
