"""`kvserve bench sweep`: the latency-throughput curve, one `bench serve` run per point.

Each base URL is measured over the same list of concurrencies (or request rates) with the same
prompts; the PNG plots output throughput against TTFT p50/p99 and ITL p50, one line per server.
"""

from __future__ import annotations

import argparse
import copy
import math
from typing import Any

from kvserve.bench.serve import prepare, run_serve
from kvserve.bench.served_model import served_model


def parse_points(spec: str, whole: bool = False) -> list[float]:
    """'1,8,32' -> [1.0, 8.0, 32.0]; 'inf' allowed for rates. whole: concurrencies, which must
    be whole numbers (0.5 ran with no cap at all, inf was an OverflowError after the setup)."""
    try:
        points = [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"points: {spec!r} must be comma-separated numbers") from None
    if not points or any(math.isnan(p) or p <= 0 for p in points):
        raise ValueError("points: give at least one positive value")
    if whole and not all(math.isfinite(p) and p == int(p) for p in points):
        raise ValueError(f"concurrencies: {spec!r} must be whole numbers >= 1")
    return points


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """Runs every (server, point); servers one after another so they never share the load."""
    if bool(args.concurrencies) == bool(args.rates):
        raise ValueError("sweep: give exactly one of --concurrencies or --rates")
    labels = args.label or []
    if labels and len(labels) != len(args.base_url):
        raise ValueError("label: give one --label per --base-url")
    kind = "max_concurrency" if args.concurrencies else "request_rate"
    points = parse_points(args.concurrencies or args.rates, whole=kind == "max_concurrency")
    # without --model, each server's own name (two servers may serve the model under two names)
    served = {url: served_model(url, args.api_key) for url in args.base_url} if args.model is None else {}
    if served:
        first = served[args.base_url[0]]
        args.model, args.model_root = first.id, first.root
    tok, requests = prepare(args)
    series, interrupted = [], False
    for i, url in enumerate(args.base_url):
        runs = []
        for p in points:
            a = copy.copy(args)
            a.model = served[url].id if served else args.model
            if kind == "max_concurrency":
                a.max_concurrency = int(p)
            else:
                a.request_rate = p
            res = run_serve(a, url, tok, requests)
            m = res["metrics"]
            ttft, itl = m["ttft_ms"], m["itl_ms"]
            print(
                f"{url} {kind}={p:g}: {m['output_throughput']:.1f} tok/s, "
                f"TTFT p50 {ttft['p50'] or 0:.1f} ms, p99 {ttft['p99'] or 0:.1f} ms, "
                f"ITL p50 {itl['p50'] or 0:.2f} ms, failed {m['failed']}"
            )
            # the swept key as this file has it (an unbounded rate null), not vLLM's flat "inf"
            runs.append({kind: None if math.isinf(p) else p, **{k: v for k, v in res.items() if k != kind}})
            if m.get("interrupted"):
                interrupted = True
                break
        series.append({"label": labels[i] if labels else url, "base_url": url, "runs": runs})
        if interrupted:  # Ctrl-C: the runs so far are plotted and saved, no further one starts
            break
    return {"sweep": kind, "points": [None if math.isinf(p) else p for p in points], "series": series}


def plot_sweep(sweep: dict[str, Any], path: str, title: str | None = None) -> None:
    """Output throughput (x) against TTFT p50/p99 and ITL p50 (y, log scale), one colour per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_itl) = plt.subplots(1, 2, figsize=(12, 4.8))
    key = sweep["sweep"]
    for i, s in enumerate(sweep["series"]):
        color = f"C{i}"
        ok = [r for r in s["runs"] if r["metrics"]["completed"]]
        x = [r["metrics"]["output_throughput"] for r in ok]
        p50 = [r["metrics"]["ttft_ms"]["p50"] for r in ok]
        p99 = [r["metrics"]["ttft_ms"]["p99"] for r in ok]
        itl = [r["metrics"]["itl_ms"]["p50"] for r in ok]
        ax_ttft.plot(x, p50, "o-", color=color, label=f"{s['label']} TTFT p50")
        ax_ttft.plot(x, p99, "s--", color=color, label=f"{s['label']} TTFT p99")
        ax_itl.plot(x, itl, "o-", color=color, label=f"{s['label']} ITL p50")
        for r, xi, yi in zip(ok, x, p50):
            v = r[key]
            ax_ttft.annotate("inf" if v is None else f"{v:g}", (xi, yi), textcoords="offset points",
                             xytext=(4, 4), fontsize=8, color=color)  # fmt: skip
    what = "concurrency" if key == "max_concurrency" else "request rate"
    ax_ttft.set(xlabel="output throughput (tok/s)", ylabel="TTFT (ms)", yscale="log",
                title=f"TTFT vs throughput (labels: {what})")  # fmt: skip
    ax_itl.set(xlabel="output throughput (tok/s)", ylabel="ITL p50 (ms)", yscale="log",
               title="inter-token latency vs throughput")  # fmt: skip
    for ax in (ax_ttft, ax_itl):
        ax.set_xscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
