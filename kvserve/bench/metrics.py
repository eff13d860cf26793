"""Turn per-request timings into the serving metrics users compare stacks by.

TTFT: request sent -> first chunk with text (for an answer with none, the chunk that ends it).
ITL: gap between consecutive text chunks of one choice (a chunk may carry several tokens; that
is what a user sees; with n > 1 each choice is its own series). TPOT: (e2e - TTFT) / (output
tokens per choice - 1), per request; output tokens count every choice. Throughputs divide by the wall
time of the whole run, first send to last byte. Goodput counts only requests that met every SLO
given (milliseconds).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvserve.bench.loadgen import INTERRUPTED, RequestResult

PERCENTILES = (50, 90, 99)


def tpot(r: RequestResult) -> float | None:
    """Per choice: with n > 1 the choices decode side by side, each at this pace."""
    per_choice = r.output_tokens / max(1, r.choices)
    return (r.latency - r.ttft) / (per_choice - 1) if per_choice > 1 else None


def summary_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean / p50 / p90 / p99 in milliseconds (None when there is nothing to summarise)."""
    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    return {"mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    t = tpot(r)
    checks = {
        "ttft": r.ttft,
        "tpot": t if t is not None else 0.0,
        "itl": max(r.itl, default=0.0),
        "e2el": r.latency,
    }
    return all(checks[k] * 1000.0 <= ms for k, ms in slo.items())


def latency_series(ok: list[RequestResult]) -> dict[str, list[float]]:
    """The completed requests' TTFT, TPOT, ITL and end-to-end latencies, in seconds."""
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := tpot(r)) is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }


def compute_metrics(
    results: list[RequestResult], duration: float, slo: dict[str, float] | None = None
) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    cut = sum(1 for r in results if r.error == INTERRUPTED)  # the user's doing, not the server's
    in_tok = sum(r.prompt_len for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok) - cut,
        "duration_s": duration,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tok / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tok + out_tok) / duration if duration > 0 else 0.0,
        **{f"{name}_ms": summary_ms(values) for name, values in latency_series(ok).items()},
    }
    if slo:
        good = sum(1 for r in ok if meets_slo(r, slo))
        m["slo_ms"] = dict(slo)
        m["good_requests"] = good
        m["goodput"] = good / duration if duration > 0 else 0.0
    errors = sorted({r.error for r in results if not r.success and r.error != INTERRUPTED})
    if errors:
        m["errors"] = errors[:5]
    if cut:
        m["interrupted"] = cut
    return m
