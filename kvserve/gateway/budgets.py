"""Money: what a request may cost at most (reserved before forwarding) and what it did cost
(settled from the usage the backend reported)."""

from __future__ import annotations

from kvserve.gateway.config import Backend, parse_duration
from kvserve.gateway.state.base import period_index, period_start

DEFAULT_MAX_TOKENS = 4096  # reserved when the client gives no max_tokens and the context is unknown
# JSON integers have no bound, floats do: a count past this (10**400 would raise OverflowError in
# the cost arithmetic) is reserved as this, dearer than any budget; the backend refuses the value
_MAX_COUNT = 2**53


def _count(x: object) -> int | None:
    """A positive integer count (not a bool), bounded; else None."""
    return min(x, _MAX_COUNT) if isinstance(x, int) and not isinstance(x, bool) and x > 0 else None


def completion_budget(body: dict, prompt_tokens: int, max_context: int | None) -> int:
    """The most completion tokens this request can produce."""
    n = _count(body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens"))
    if n is not None:
        return n
    if max_context:
        return max(max_context - prompt_tokens, 1)
    return DEFAULT_MAX_TOKENS


def sequences(body: dict) -> int:
    """Completions one request can draw, each up to max_tokens and each billed: n, or best_of
    when larger, for every prompt of a completions batch (a list of strings or of token lists)."""
    n, best_of, prompt = body.get("n"), body.get("best_of"), body.get("prompt")
    per_prompt = max(_count(x) or 1 for x in (n, best_of))
    batch = isinstance(prompt, list) and bool(prompt) and not all(isinstance(x, int) for x in prompt)
    return max(per_prompt, 1) * (len(prompt) if batch else 1)


def max_cost(backends: list[Backend], body: dict, prompt_tokens: int, n: int = 1,
             completion: bool = True) -> tuple[float, int]:  # fmt: skip
    """Reservation: the dearest any backend the request could reach could make it, each at its
    own longest answer (without max_tokens, its own context less the prompt: the router picks
    after admission, so the first deployment's context may be far shorter than the one that
    answers); and that backend's completion budget."""
    best = (0.0, 0)
    for b in backends:
        tokens = completion_budget(body, prompt_tokens, b.max_context) if completion else 0
        money = b.input_cost_per_token * prompt_tokens + b.output_cost_per_token * tokens * n
        best = max(best, (money, tokens))
    return best


def cost(backend: Backend, usage: dict | None) -> float | None:
    """Actual cost from an OpenAI usage object; None when the backend reported none."""
    if not usage:
        return None
    p, c = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
    return backend.input_cost_per_token * p + backend.output_cost_per_token * c


def budget_period(budget_duration: str | None, now: float) -> tuple[float, float | None]:
    """(since when a budget's spend counts, when it next resets): the period admission counts
    (calendar boundaries, state/base.py); without budget_duration the whole log, and never."""
    if budget_duration is None:
        return 0.0, None
    p = parse_duration(budget_duration)
    i = period_index(now, p)
    return period_start(i, p), period_start(i + 1, p)
