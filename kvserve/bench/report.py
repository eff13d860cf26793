"""Print a benchmark result as a readable table and save it as JSON (fields: docs/BENCH.md)."""

from __future__ import annotations

import json
from typing import Any

_W = 52


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.2f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def _asked_percentiles(result: dict[str, Any], name: str, shown: dict[str, Any]) -> list[tuple[str, Any]]:
    """--metric-percentiles' flat keys (p99.9_ttft_ms, ...) the nested summary does not show."""
    found = []
    for key, v in result.items():
        word = key[1 : -len(f"_{name}_ms")] if key.startswith("p") and key.endswith(f"_{name}_ms") else ""
        if word.replace(".", "", 1).isdigit() and f"p{word}" not in shown:
            found.append((float(word), word, v))
    return [(word, v) for _, word, v in sorted(found)]


def format_table(result: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    m = result["metrics"]
    rows: list[tuple[str, Any]] = [
        ("Backend URL", result.get("base_url")),
        ("Endpoint", result.get("endpoint")),
        ("Successful requests", m["completed"]),
        ("Failed requests", m["failed"]),
        ("Interrupted requests (Ctrl-C)", m.get("interrupted")),
        ("Benchmark duration (s)", m["duration_s"]),
        ("Total input tokens", m["total_input_tokens"]),
        ("Total output tokens", m["total_output_tokens"]),
        ("Request throughput (req/s)", m["request_throughput"]),
        ("Output token throughput (tok/s)", m["output_throughput"]),
        ("Total token throughput (tok/s)", m["total_token_throughput"]),
    ]
    if "goodput" in m:
        slo = ",".join(f"{k}:{v:g}" for k, v in m["slo_ms"].items())
        rows.append((f"Goodput (req/s, {slo} ms)", m["goodput"]))
    lines = [f" {title} ".center(_W, "=")]
    lines += [f"{k + ':':<38}{_fmt(v):>{_W - 38}}" for k, v in rows if v is not None]
    names = {"ttft_ms": "Time to First Token", "tpot_ms": "Time per Output Token (excl. 1st)",
             "itl_ms": "Inter-token Latency", "e2el_ms": "End-to-end Latency"}  # fmt: skip
    for key, name in names.items():
        lines.append(f" {name} ".center(_W, "-"))
        for stat, v in m[key].items():
            label = f"{stat.capitalize() if stat == 'mean' else stat.upper()} {key[:-3].upper()} (ms):"
            lines.append(f"{label:<38}{_fmt(v):>{_W - 38}}")
        for word, v in _asked_percentiles(result, key[:-3], m[key]):
            lines.append(f"{f'P{word} {key[:-3].upper()} (ms):':<38}{_fmt(v):>{_W - 38}}")
    spec = result.get("spec_decode")
    if spec:
        lines.append(" Speculative Decoding ".center(_W, "-"))
        for label, v in (
            ("Drafts", spec["drafts"]),
            ("Draft acceptance rate (%)", 100 * spec["acceptance_rate"]),
            ("Mean acceptance length (tok/step)", spec["mean_acceptance_length"]),
        ):
            lines.append(f"{label + ':':<38}{_fmt(v):>{_W - 38}}")
    lines.append("=" * _W)
    for e in m.get("errors", []):
        lines.append(f"error: {e}")
    return "\n".join(lines)


def save_json(result: dict[str, Any], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
