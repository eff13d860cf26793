"""OpenAI's list endpoints (files, batches, a response's input items): one page's shape, and
the range its `limit` must lie in.

OpenAI refuses a `limit` outside its range with a 400 naming it, rather than answering a
page of another size than asked for: a client paging by a limit it believes was honoured
would otherwise miss or repeat items without being told.
"""

from __future__ import annotations


def limit_problem(limit: int, most: int) -> tuple[str, str] | None:
    """(message, code) for a `limit` outside [1, most], in OpenAI's words; None when it is in."""
    if limit < 1:
        return (
            f"Invalid 'limit': integer below minimum value. Expected a value >= 1, but got {limit} instead.",
            "integer_below_min_value",
        )
    if limit > most:
        return (
            f"Invalid 'limit': integer above maximum value. Expected a value <= {most}, "
            f"but got {limit} instead.",
            "integer_above_max_value",
        )
    return None


def page(data: list[dict], has_more: bool) -> dict:
    """A list page: the items, the ids at its ends (None when it is empty), and has_more."""
    first = data[0]["id"] if data else None
    last = data[-1]["id"] if data else None
    return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": has_more}
