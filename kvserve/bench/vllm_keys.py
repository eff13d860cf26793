"""A `bench serve` result's numbers also under the flat keys vLLM's benchmark_serving.py (and
`vllm bench serve`) writes (`request_throughput`, `mean_ttft_ms`, `p99_itl_ms`, ...): scripts
written against vLLM's result files read those names, not kvserve's nested `metrics`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvserve.bench.loadgen import RequestResult
from kvserve.bench.metrics import PERCENTILES, latency_series

_COPIED = (
    "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "output_throughput", "total_token_throughput",
)  # fmt: skip


def percentile_word(p: float) -> str:
    """vLLM's spelling of a percentile in a key: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def _stats(name: str, values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float | None]:
    """mean / median / std / pNN of one series, in ms, named as vLLM names them."""
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    empty = a.size == 0
    out = {
        f"mean_{name}_ms": None if empty else float(a.mean()),
        f"median_{name}_ms": None if empty else float(np.median(a)),
        f"std_{name}_ms": None if empty else float(a.std()),
    }
    for p in percentiles:
        out[f"p{percentile_word(p)}_{name}_ms"] = None if empty else float(np.percentile(a, p))
    return out


def vllm_keys(
    results: list[RequestResult],
    metrics: dict[str, Any],
    load: dict[str, Any],
    model: str,
    detailed: bool,
    selected: tuple[str, ...] | None = None,
    percentiles: tuple[float, ...] | None = None,
) -> dict[str, Any]:
    """The flat keys; with `detailed`, vLLM's per-request lists too (input_lens, ttfts, ...).
    `selected` / `percentiles` are vLLM's --percentile-metrics / --metric-percentiles: only
    those latencies get keys, with those percentiles (default: all four, at 50, 90, 99)."""
    rate = load["request_rate"]
    out: dict[str, Any] = {
        "backend": "openai",
        "model_id": model,
        "num_prompts": len(results),
        "request_rate": "inf" if rate is None or math.isinf(rate) else rate,
        "burstiness": load["burstiness"],
        "max_concurrency": load["max_concurrency"],
        "duration": metrics["duration_s"],
        **{k: metrics[k] for k in _COPIED},
        "request_goodput": metrics.get("goodput"),
    }
    ok = [r for r in results if r.success]
    for name, values in latency_series(ok).items():
        if selected is None or name in selected:
            out.update(_stats(name, values, percentiles or PERCENTILES))
    if detailed:
        out["input_lens"] = [r.prompt_len for r in results]
        out["output_lens"] = [r.output_tokens for r in results]
        out["ttfts"] = [r.ttft for r in results]
        out["itls"] = [r.itl for r in results]
        out["errors"] = [r.error for r in results]
    return out
