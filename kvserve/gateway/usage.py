"""A backend's `usage` object as the gateway counts it. Backends differ (some leave out
total_tokens, a broken one may send nulls, strings or a list), and the settlement after an
answer must not fail on that: it is what releases the key's slots and reservation."""

from __future__ import annotations

import math


def _tokens(x: object) -> int | None:
    """A token count: a non-negative finite number (not a bool), as an int; else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
        return None
    return int(x)


def normalized(usage: object) -> dict | None:
    """prompt, completion and total tokens as ints (a missing or unusable count is 0; a total
    missing or short of prompt + completion is their sum); None when it is not an object. The
    Responses API's input_tokens / output_tokens are the same counts by other names."""
    if not isinstance(usage, dict):
        return None
    p = _tokens(usage.get("prompt_tokens", usage.get("input_tokens"))) or 0
    c = _tokens(usage.get("completion_tokens", usage.get("output_tokens"))) or 0
    t = _tokens(usage.get("total_tokens"))
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": max(t or 0, p + c)}
