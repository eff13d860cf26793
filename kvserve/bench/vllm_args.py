"""`vllm bench serve` / benchmark_serving.py spellings `kvserve bench serve` takes, so a vLLM
user's command runs as written: --host / --port for --base-url, --backend openai-chat and
--endpoint /v1/chat/completions for --endpoint chat, --save-result as a switch with
--result-dir / --result-filename, --percentile-metrics / --metric-percentiles for the flat
keys written (vllm_keys.py), --goodput for --slo, --num-warmups for --warmup, --metadata
KEY=VALUE written into the result, --served-model-name (the name sent; --model then names the
tokenizer) and --trust-remote-code (kvserve's tokenizers run no model code). (--dataset-name,
--random-input-len, --random-output-len and --random-range-ratio are in args.py.) Each was
"unrecognized arguments" or "invalid choice"; `--save-result --result-filename x.json` was
"expected one argument"."""

from __future__ import annotations

import argparse
import datetime
import math
import os

from kvserve.argtypes import non_negative_int, port, writable_file
from kvserve.bench.slo import SLO_KEYS, parse_slo

SAVE_NAMED = "<named from the run>"  # --save-result with no file: vLLM's switch
_BACKENDS = {"vllm": "completions", "openai": "completions", "openai-chat": "chat"}
_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def endpoint(text: str) -> str:
    """kvserve's `completions` / `chat`, or vLLM's path for either."""
    value = _PATHS.get(text.rstrip("/"), text)
    if value not in ("completions", "chat"):
        raise argparse.ArgumentTypeError(
            f"must be completions or chat (or vLLM's /v1/completions, /v1/chat/completions), got {text!r}"
        )
    return value


def percentile_metrics(text: str) -> tuple[str, ...]:
    """vLLM's --percentile-metrics: a comma list of ttft, tpot, itl, e2el."""
    names = tuple(n.strip().lower() for n in text.split(","))
    for n in names:
        if n not in SLO_KEYS:
            raise argparse.ArgumentTypeError(f"{n!r} is not one of {', '.join(SLO_KEYS)} (a comma list)")
    if len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"a metric is given twice in {text!r}")
    return names


def metric_percentiles(text: str) -> tuple[float, ...]:
    """vLLM's --metric-percentiles: a comma list of percentiles, e.g. 50,90,99.9."""
    out = []
    for part in text.split(","):
        try:
            p = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part.strip()!r} is not a number (a comma list, e.g. 50,90,99)"
            ) from None
        if not 0 < p <= 100:  # (also nan)
            raise argparse.ArgumentTypeError(f"each must be in (0, 100], got {part.strip()!r}")
        if p in out:
            raise argparse.ArgumentTypeError(f"{part.strip()} is given twice")
        out.append(p)
    return tuple(out)


def metadata_pair(text: str) -> tuple[str, str]:
    """vLLM's --metadata KEY=VALUE: a key written into the result with its value."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} must be KEY=VALUE (e.g. version=0.3.3)")
    return key.strip(), value.strip()


def add_vllm_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM's spellings")
    g.add_argument("--host", default=None, help="the server's host, as vLLM's, for --base-url (127.0.0.1)")
    g.add_argument("--port", type=port, default=None, help="the server's port, as vLLM's (8000)")
    g.add_argument("--backend", choices=tuple(_BACKENDS), default=None,
                   help="vLLM's: openai-chat is --endpoint chat, vllm / openai completions")  # fmt: skip
    g.add_argument("--result-dir", default=None, help="with --save-result and no file: the folder")
    g.add_argument("--result-filename", default=None, help="with --save-result and no file: the name")
    g.add_argument("--percentile-metrics", type=percentile_metrics, default=None,
                   help="vLLM's: the latencies given flat keys in the result, from ttft,tpot,itl,e2el "
                        "(default all four)")  # fmt: skip
    g.add_argument("--metric-percentiles", type=metric_percentiles, default=None,
                   help="vLLM's: their percentiles, e.g. 50,90,99.9 (default 50,90,99)")  # fmt: skip
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="vLLM's spelling of --slo: ttft:500 tpot:50")  # fmt: skip
    g.add_argument("--num-warmups", type=non_negative_int, default=None, help="vLLM's spelling of --warmup")
    g.add_argument("--metadata", nargs="+", type=metadata_pair, default=None, metavar="KEY=VALUE",
                   help="vLLM's: written into the result (e.g. version=0.3.3 tp=1)")  # fmt: skip
    g.add_argument("--served-model-name", default=None,
                   help="vLLM's: the model name sent; --model then names the tokenizer")  # fmt: skip
    g.add_argument("--trust-remote-code", action="store_true",
                   help="vLLM's; accepted: kvserve's tokenizers run no model's own code")  # fmt: skip


def _default_name(args: argparse.Namespace) -> str:
    """vLLM's: backend, rate, concurrency, model, time."""
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    model = os.path.basename(str(args.model).rstrip("/")) or "model"
    when = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{args.backend or 'openai'}-{rate}qps{conc}-{model}-{when}.json"


def resolve_vllm_serve_args(args: argparse.Namespace) -> str | None:
    """Fold vLLM's spellings into kvserve's options; an error message, or None."""
    if args.host is not None or args.port is not None:
        if args.base_url is not None:
            return "base-url: give --base-url or --host / --port, not both"
        host = args.host or "127.0.0.1"
        where = f"[{host}]" if ":" in host else host
        args.base_url = f"http://{where}:{args.port or 8000}"
    args.base_url = args.base_url or "http://127.0.0.1:8000"
    if args.backend is not None:
        wanted = _BACKENDS[args.backend]
        if args.endpoint == "chat" and wanted != "chat":  # completions is the default: not asked for
            return f"backend: --backend {args.backend} is --endpoint completions, not chat"
        args.endpoint = wanted
    problem = _goodput(args) or _num_warmups(args)
    if problem:
        return problem
    if args.served_model_name is not None:  # vLLM's --model is then the tokenizer's
        if args.tokenizer is None and args.model is not None:
            args.tokenizer = args.model
        args.model = args.served_model_name
    named = args.result_dir is not None or args.result_filename is not None
    if named and args.save_result not in (None, SAVE_NAMED):
        return "result-filename: --save-result was given a file; drop --result-dir / --result-filename"
    if named and args.save_result is None:
        return "result-filename: needs --save-result (as vLLM's: the file is written only with it)"
    return None


def _goodput(args: argparse.Namespace) -> str | None:
    if args.goodput is None:
        return None
    if args.slo is not None:
        return "goodput: give --slo or --goodput (vLLM's spelling of it), not both"
    text = ",".join(args.goodput)
    try:
        parse_slo(text)
    except ValueError as e:
        return f"goodput: {str(e).removeprefix('slo: ')}"
    args.slo = text
    return None


def _num_warmups(args: argparse.Namespace) -> str | None:
    if args.num_warmups is None:
        return None
    if args.warmup not in (0, args.num_warmups):
        return "num-warmups: give --warmup or --num-warmups (vLLM's spelling of it), not both"
    args.warmup = args.num_warmups
    return None


def named_result_file(args: argparse.Namespace) -> str:
    """--save-result's file when it was given as a switch (after the model is known)."""
    path = os.path.join(args.result_dir or ".", args.result_filename or _default_name(args))
    try:
        return writable_file(path)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"save-result: {e}") from None
