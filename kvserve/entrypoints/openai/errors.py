"""OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import re
from collections.abc import Sequence

from fastapi.responses import JSONResponse

from kvserve.engine.processor import ContextLengthError
from kvserve.entrypoints.openai.response_store import PreviousResponseNotFoundError


class EmptyStringError(ValueError):
    """A string field given as "" where OpenAI requires a character at least (its code
    empty_string)."""


class OpenAIErrorResponse(JSONResponse):
    body_dict: dict


def error_response(
    status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code=None
) -> OpenAIErrorResponse:
    body = {"message": message, "type": type_, "param": param, "code": code if code is not None else status}
    resp = OpenAIErrorResponse({"error": body}, status_code=status)
    resp.body_dict = body
    return resp


def param_of(message: str) -> str | None:
    """Our ValueErrors start with the field name ("top_p: must be ..."): report it as param."""
    head, sep, _ = message.partition(":")
    return head.strip() if sep and head.strip().replace("_", "").isalnum() else None


# What pydantic puts in an error's location for a union's member rather than a field.
_MEMBER_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list", "bytes"})


def field_path(loc: Sequence[str | int]) -> str:
    """A validation error's field as a client writes it ("messages[1].tool_calls[0].function.name"),
    up to the first part that names a union member (str, list[str], NamedToolChoice, ...), not a
    field: a bare "messages: Field required" named neither the message nor the field. A part
    holding "=" ("type=function") is a discriminated union's tag, the member the value itself
    chose: the path goes on through it."""
    path = str(loc[0])
    for part in loc[1:]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif "=" in part:
            continue
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", part) and part not in _MEMBER_TAGS:
            path += f".{part}"
        else:
            break
    return path


def shown_json(text: str) -> str:
    """Text that should have been JSON, as an error quotes it: its start, repr'd."""
    return repr(text if len(text) <= 40 else text[:40] + "...")


def renamed_in_text(text: str, old: str, new: str) -> str:
    """`text` with the field `old` named `new` wherever it names it ("lower max_tokens"), not
    inside a longer name or a quoted value the client sent ('max_tokens', a function's name)."""
    return re.sub(rf"(?<![\w'\"]){re.escape(old)}(?![\w'\"])", new, text)


def value_error_code(exc: ValueError) -> str:
    """The code of a 400 raised as a ValueError: OpenAI's for a request past the context, for
    a previous_response_id that names no stored response, and for an empty string."""
    if isinstance(exc, PreviousResponseNotFoundError):
        return "previous_response_not_found"
    if isinstance(exc, EmptyStringError):
        return "empty_string"
    return "context_length_exceeded" if isinstance(exc, ContextLengthError) else "invalid_value"


def specific_error(errors: list[dict]) -> dict:
    """The error to report of FastAPI's list: for a union field (stop: a string or a list) each
    member reports one, the first usually "Input should be a valid string" even when the value
    was a list that broke the list member's limit; the first error of the same field that is
    not a type mismatch says what is wrong."""
    if not errors:
        return {}
    first = errors[0]
    field = tuple(first.get("loc", ()))[:2]
    for error in errors:
        if tuple(error.get("loc", ()))[:2] == field and not str(error.get("type", "")).endswith("_type"):
            return error
    return first


def unreadable_body(error: dict, content_type: str | None = None) -> str | None:
    """The message for a body that is not a JSON object at all (FastAPI's first validation
    error for it), else None: its location is a character offset or the body itself, not a
    field, so the usual "field: message" would name no field (or a number). A body sent with
    another Content-Type (curl -d sends a form's) is never read as JSON: that is what to say."""
    kind, loc = error.get("type"), tuple(error.get("loc", ()))
    if kind == "json_invalid":
        why = error.get("ctx", {}).get("error", "decode error")
        where = f" at character {loc[1]}" if len(loc) > 1 else ""
        return f"the request body is not valid JSON ({why}{where})"
    if loc == ("body",):
        if kind == "missing":
            return "the request body is missing"
        media = (content_type or "").split(";")[0].strip().lower()
        if content_type is not None and not (media == "application/json" or media.endswith("+json")):
            sent = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
            return f"the body must be JSON sent with Content-Type: application/json (this one had {sent})"
        return "the body must be a JSON object"
    return None


def unparsable_body(exc: BaseException) -> str | None:
    """The message for a body FastAPI could not decode for a reason other than a JSON syntax
    error (it says only "There was an error parsing the body"), from the error behind it;
    None when the cause is not one of these."""
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        byte = cause.object[cause.start : cause.start + 1].hex()
        return f"the request body is not valid JSON (not UTF-8: byte 0x{byte} at offset {cause.start})"
    if isinstance(cause, RecursionError):
        return "the request body is not valid JSON (arrays or objects nested too deeply)"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return "the request body is not valid JSON (a number with too many digits)"
    return None
