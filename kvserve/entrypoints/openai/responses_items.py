"""A response's input items, as GET /v1/responses/{id}/input_items lists them.

They are the items the request sent, each given an id (OpenAI's cursors are item ids) and a
status, a string input being one user message, and a message's string content being one
text part; kept with the stored response. Items of earlier responses in a
previous_response_id chain are listed under those responses' own ids. An `item_reference`
input item names one such item (or an output item) by id: it stands for that item.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable
from typing import Any

from kvserve.entrypoints.openai.listing import page
from kvserve.entrypoints.openai.response_store import ItemNotFoundError, ResponseNotFoundError

MAX_LIMIT = 100  # OpenAI's range for this list: 1 to 100, 20 by default
# A front (gateway, pd-proxy, Ray Serve front) routes a follow-up by previous_response_id, whose id
# names the server storing it; an item id names none, so a reference may reach a server without it.
_ELSEWHERE = (
    "behind a gateway, pd-proxy or Ray Serve front another server may hold it: they route by "
    "previous_response_id, not by item id; continue its response with previous_response_id, "
    "or send the item itself"
)
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def resolved(items: str | list[Any] | None, find: Callable[[str], dict]) -> str | list[Any] | None:
    """The input with each item_reference replaced by the stored item it names (`find`: by
    id). OpenAI's reference may leave out its type: an item of an id alone, no role."""
    if not isinstance(items, list):
        return items
    out = []
    for i, item in enumerate(items):
        if not _is_reference(item):
            out.append(item)
            continue
        ref = item.get("id")
        if not isinstance(ref, str) or not ref:
            raise ValueError(f"input: item {i} (item_reference) needs id, a non-empty string")
        try:
            out.append(copy.deepcopy(find(ref)))
        except ItemNotFoundError:  # (behind a front, "never stored" sent users looking for a bug)
            raise ValueError(
                f"input: item {i} (item_reference) names {ref!r}, which no response stored on this "
                f"server holds (never stored, or expired; {_ELSEWHERE})"
            ) from None
    return out


def chain_items(previous_id: str, held: Callable[[str], tuple[dict, list[dict]]]) -> list[dict[str, Any]]:
    """The items previous_response_id carries: those of the response it names and of every
    earlier one in its chain (`held`: a response and its input items, by id), as far back as
    they are stored. Only the previous response's were checked: an item of a turn before it,
    passed back, reached the model twice though OpenAI refuses it as a duplicate."""
    items: list[dict[str, Any]] = []
    rid: Any = previous_id
    while isinstance(rid, str) and rid:
        try:
            response, input_items = held(rid)
        except ResponseNotFoundError:  # deleted or expired: its turns ride in the conversation only
            break
        items += [i for i in [*input_items, *response["output"]] if isinstance(i.get("id"), str)]
        rid = response.get("previous_response_id")
    return items


def refuse_duplicates(items: str | list[Any] | None, carried: list[dict[str, Any]]) -> None:
    """OpenAI's 400 for an item id given twice: in the input, or in the input and the items
    previous_response_id already brings (`carried`: chain_items; passed back too, the model read
    them twice). Two items of one id also made the input_items cursors ambiguous."""
    if not isinstance(items, list):
        return
    seen = {item["id"] for item in carried}
    for i, item in enumerate(items):
        given = item.get("id") if isinstance(item, dict) else None
        if not isinstance(given, str) or not given:
            continue
        if given in seen:
            where = "an earlier item of the input"
            if any(c["id"] == given for c in carried):
                where = "the items previous_response_id carries (of that response or one before it)"
            raise ValueError(
                f"input: item {i}: Duplicate item found with id {given!r}, also in {where}; "
                "remove duplicate items from your input"
            )
        seen.add(given)


def _is_reference(item: Any) -> bool:
    if not isinstance(item, dict):
        return False
    untyped = "type" not in item and "role" not in item and "id" in item
    return item.get("type") == "item_reference" or untyped


def stored_input_items(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's `input` (already checked by input_messages) as the items to list."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    stored = []
    for item in items:
        kind = item.get("type", "message")
        out = {"id": item.get("id") or f"{_ID_PREFIX.get(kind, 'item')}_{uuid.uuid4().hex}", **item}
        out["type"], out["status"] = kind, item.get("status") or "completed"
        if kind == "message" and isinstance(out.get("content"), str):
            part = "output_text" if out.get("role") == "assistant" else "input_text"
            extra = {"annotations": []} if part == "output_text" else {}
            out["content"] = [{"type": part, "text": out["content"], **extra}]
        stored.append(out)
    return stored


def input_items_page(
    items: list[dict[str, Any]], after: str | None, before: str | None, limit: int, order: str
) -> dict[str, Any]:
    """One page of at most `limit` (checked by the caller) in `order` (asc: as sent), starting
    past `after` and ending before `before`; ValueError naming a cursor not among the items."""
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    start, end = 0, len(ordered)
    for name, cursor in (("after", after), ("before", before)):
        if cursor is not None and cursor not in ids:
            raise ValueError(f"{name}: no input item with id {cursor!r} in this response")
    if after is not None:
        start = ids.index(after) + 1
    if before is not None:
        end = ids.index(before)
    window = ordered[start:end]
    return page(window[:limit], has_more=len(window) > limit)
