"""`--slo`: goodput targets in milliseconds, parsed apart from the metrics so the flag is checked
while the arguments are parsed, with nothing heavy imported."""

from __future__ import annotations

import math

SLO_KEYS = ("ttft", "tpot", "itl", "e2el")


def parse_slo(spec: str | None) -> dict[str, float]:
    """'ttft:500,tpot:50' -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    if not spec:
        return {}
    out = {}
    for part in spec.split(","):
        key, sep, value = part.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"slo: {part!r} must be KEY:MS with KEY one of {', '.join(SLO_KEYS)}")
        if key in out:  # the last one silently won
            raise ValueError(f"slo: {key} is given twice")
        try:
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"slo: {value!r} is not a number of milliseconds") from None
        # nan failed every request and inf passed every one; both were written into the result
        # as NaN / Infinity, which is not JSON
        if not math.isfinite(out[key]) or out[key] <= 0:
            raise ValueError(f"slo: {key} must be a positive number of milliseconds, got {value.strip()!r}")
    return out
