"""A conversation with more turns than the context has tokens, refused before any work on it.

Every turn a chat template renders carries at least one token of markup (a role header, an
end-of-turn marker), so a list of more messages than max_model_len can never fit. A 12 MB body
of 340,000 one-letter messages was validated (3 s of a core), converted and rendered (7 s) before
the rendered text's length refused it, and the garbage it made ran the GC in passes of a quarter
second that held every other stream. Counted right after the body is decoded (in the body
parser's thread, before pydantic sees a message), it is refused in the time the decode takes.
"""

from __future__ import annotations

from typing import Any

from kvserve.engine.processor import ContextLengthError

# The routes whose body holds a conversation for the chat template, and the field holding it.
_TURNS = {"/v1/chat/completions": "messages", "/tokenize": "messages", "/v1/responses": "input"}


def check_message_count(field: str, count: int, max_model_len: int) -> None:
    """Refuse `count` turns that cannot fit max_model_len tokens (context_length_exceeded)."""
    if count > max_model_len:
        raise ContextLengthError(
            field, max_model_len, f"{count} messages can never fit it (each takes at least one token)"
        )


def precheck_body(path: str, data: Any, max_model_len: int) -> None:
    """The count check on a decoded body, before validation. A Responses request with truncation
    "auto" is left alone: the oldest of its items are dropped until the rest fit."""
    field = _TURNS.get(path)
    if field is None or not isinstance(data, dict):
        return
    turns = data.get(field)
    if not isinstance(turns, list) or (field == "input" and data.get("truncation") == "auto"):
        return
    check_message_count(field, len(turns), max_model_len)
