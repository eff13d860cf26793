"""When to try again and how long to wait: capped exponential backoff with full jitter (so
retrying gateways do not synchronise), never shorter than a backend's Retry-After."""

from __future__ import annotations

import math
import random

from kvserve.gateway.errors import backend_error

RETRYABLE_STATUS = frozenset({408, 429}) | frozenset(range(500, 600))
# The gateway sends the backend its own credentials (the deployment's api_key), never the
# client's: a 401 or 403 is a deployment set up wrong, not the client's mistake. Passed
# through, it told the client its own key was bad, and the group's other deployments were
# never tried; now it is retried elsewhere, counts towards the cooldown, and ends as a 502.
CREDENTIALS_STATUS = frozenset({401, 403})
# A 404 to a chat, completions or embeddings request is a deployment set up wrong too (its
# `model` is not the backend's, or its base_url misses the route: the alias the client named
# exists); passed through, the client read "model not found" for a model the gateway lists.


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
        seconds = float(value)
    except ValueError:
        return None  # an HTTP date: rare from model servers; fall back to our own backoff
    # float() also reads "nan" and "inf": the final 429's own Retry-After was int() of it, a 500
    return max(seconds, 0.0) if math.isfinite(seconds) else None


# how servers say a prompt (with max_tokens) exceeds the model's context, lowercased: OpenAI,
# vLLM and kvserve ("maximum context length"), vLLM's "maximum model length", SGLang's "model's
# context length", llama.cpp's "available context size"; a bare "too long" is not one of them
# ("stop: sequence too long" is about the stop field, and another model would not fix it)
_CONTEXT_PHRASES = (
    "maximum context length",
    "maximum model length",
    "model's context length",
    "exceeds the available context size",
    "exceeds the context window",
)
_CONTEXT_CODES = ("context_length_exceeded", "exceed_context_size_error")


def is_context_error(status: int, body: bytes) -> bool:
    """A backend's 400 saying the prompt exceeds the model's context: OpenAI's code (or
    llama.cpp's type), else one of the known phrasings in the error's message."""
    if status != 400:
        return False
    err = backend_error(body)
    if err is None:
        fields, message = (), body[:4000].decode("utf-8", "replace")
    else:
        fields, message = (err.get("code"), err.get("type")), str(err.get("message") or "")
    if any(isinstance(f, str) and f.lower() in _CONTEXT_CODES for f in fields):
        return True
    text = message.lower()
    return any(p in text for p in _CONTEXT_PHRASES)


MAX_RETRY_AFTER = 30.0  # a backend asking for a longer pause is skipped for this request instead
