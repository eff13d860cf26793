"""When to try again and how long to wait: capped exponential backoff with full jitter (so
retrying gateways do not synchronise), never shorter than a backend's Retry-After."""

from __future__ import annotations

import random

RETRYABLE_STATUS = frozenset({408, 429}) | frozenset(range(500, 600))


def is_retryable(status: int) -> bool:
    return status in RETRYABLE_STATUS


def backoff(attempt: int, base: float, cap: float, retry_after: float | None = None) -> float:
    """Seconds to sleep before retry number `attempt` (1 = first retry)."""
    delay = random.uniform(0, min(cap, base * 2 ** (attempt - 1)))
    if retry_after:
        delay = max(delay, retry_after)
    return delay


def parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        return None  # an HTTP date: rare from model servers; fall back to our own backoff


def is_context_error(status: int, body: bytes) -> bool:
    """A backend's 'prompt too long' 400 (OpenAI, vLLM, llama.cpp and kvserve word it alike)."""
    if status != 400:
        return False
    text = body[:4000].lower()
    return any(
        s in text
        for s in (
            b"context_length_exceeded",
            b"context length",
            b"maximum context",
            b"max_model_len",
            b"too long",
            b"exceeds the context",
        )
    )


MAX_RETRY_AFTER = 30.0  # a backend asking for a longer pause is skipped for this request instead
