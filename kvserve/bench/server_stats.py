"""Speculative-decoding counters read from a kvserve server's /metrics before and after a run,
so the benchmark report can give the run's acceptance rate and mean acceptance length.
Best effort: a server without these metrics (another engine, no speculation) gives None."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def scrape_spec_counters(base_url: str, api_key: str | None = None) -> dict[str, float] | None:
    """/metrics at the server root: `--base-url` may end in /v1 (as the requests accept), and
    a server with --metrics-require-key wants the key (else 401, and no summary, unsaid)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        r = httpx.get(f"{root}/metrics", headers=headers, timeout=5)
        if r.status_code != 200:
            return None
        families = list(text_string_to_metric_families(r.text))
    except (httpx.HTTPError, ValueError):
        return None
    totals: dict[str, float] = {}
    for fam in families:
        for name in _COUNTERS:
            if fam.name == f"kvserve:spec_decode_{name}":
                totals[name] = sum(
                    s.value
                    for s in fam.samples
                    if s.name.endswith("_total") and s.labels.get("engine") != "total"  # replicas
                )
    return totals if len(totals) == len(_COUNTERS) else None


def spec_decode_summary(before: dict | None, after: dict | None) -> dict[str, Any] | None:
    """Acceptance over the run (None when nothing was drafted or the server has no counters)."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in _COUNTERS}
    if d["num_drafts"] <= 0:
        return None
    return {
        "drafts": int(d["num_drafts"]),
        "draft_tokens": int(d["num_draft_tokens"]),
        "accepted_tokens": int(d["num_accepted_tokens"]),
        "acceptance_rate": d["num_accepted_tokens"] / d["num_draft_tokens"],
        "mean_acceptance_length": 1 + d["num_accepted_tokens"] / d["num_drafts"],
    }
