"""Large JSON bodies parsed and validated in a worker thread, not on the event loop.

FastAPI decodes a route's JSON body and validates it against the route's model on the event
loop: for a body near the 16 MiB limit (300,000 short messages, a million token ids) that is a
second or more during which no other stream gets a chunk. A body past OFF_LOOP_BYTES is decoded
and validated here, in a thread, with FastAPI's own field and error shapes; FastAPI then finds
the validated model already in place (Starlette's cached `request.json()`), and passing the
instance through its validator again costs nothing. Smaller bodies keep FastAPI's path: a
thread hop would cost more than their parse.

The thread holds the GIL while a C routine runs (pydantic's loop over a long list of ints, the
decode of one value), so the loop still waits for the longest such stretch; what it no longer
waits for is the whole parse and validation, which yields between Python calls. The decode is
msgspec's, which holds it about 0.6x as long as json.loads (15 MB: 0.18 s, not 0.33 s), and a
large array of objects (messages) is decoded an element at a time, so that the loop runs in
between; a body msgspec refuses is decoded again by json.loads, whose result or error it has
always had.
"""

from __future__ import annotations

import asyncio
import email.message
import functools
import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
from fastapi import HTTPException, Request, Response, params
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

OFF_LOOP_BYTES = 64 * 1024


def is_json(content_type: str | None) -> bool:
    """FastAPI's rule for a body it reads as JSON: application/json or application/*+json."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    json_type = subtype == "json" or subtype.endswith("+json")
    return message.get_content_maintype() == "application" and json_type


def decode(body: bytes) -> Any:
    """msgspec's decode where it gives what json.loads gives (every document both accept decodes
    alike); what it refuses and json.loads takes or words its own way (NaN, a lone surrogate, a
    byte-order mark, 1e400, a number of 5,000 digits, deep nesting, bad UTF-8) goes to json.loads."""
    try:
        return _decode_in_pieces(body)
    except Exception:
        pass
    try:
        return msgspec.json.decode(body)
    except Exception:
        return json.loads(body)


PIECE_BYTES = 64 * 1024
_Fields = dict[str, msgspec.Raw]
_Items = list[msgspec.Raw]
_ARRAY_OF_CONTAINERS = re.compile(rb"\[[ \t\n\r]*[\[{]")  # its first element an object or an array


def _decode_in_pieces(body: bytes) -> dict[str, Any]:
    """An object whose large arrays of objects or arrays are decoded an element at a time. One
    decode of 300,000 messages was one C call holding the GIL for 0.2-4 s (it allocates every
    dict, and the GC passes it sets off run inside it), every stream waiting; between elements
    the event loop gets its turn. Arrays of scalars (token ids) are decoded whole: one call per
    id would cost more than it frees. Raises on anything but an object (decode falls back)."""
    fields = msgspec.json.decode(body, type=_Fields)
    out: dict[str, Any] = {}
    for key, raw in fields.items():
        text = memoryview(raw)
        if len(text) > PIECE_BYTES and _ARRAY_OF_CONTAINERS.match(bytes(text[:4096])):
            out[key] = [msgspec.json.decode(item) for item in msgspec.json.decode(raw, type=_Items)]
        else:
            out[key] = msgspec.json.decode(raw)
    return out


def parse_body(field: Any, body: bytes, precheck: Callable[[Any], None] | None = None) -> Any:
    """The body decoded and, when it is an object, validated against `field` (FastAPI's
    ModelField); errors raised as FastAPI raises them, so the app's handlers word them alike.
    `precheck` sees the decoded body first: what it refuses is never validated."""
    try:
        data = decode(body)
    except json.JSONDecodeError as e:
        error = {"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error", "input": {},
                 "ctx": {"error": e.msg}}  # fmt: skip
        raise RequestValidationError([error], body=e.doc) from e
    except Exception as e:
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from e
    if not isinstance(data, dict):  # refused at once by FastAPI's own check, with its message
        return data
    if precheck is not None:
        precheck(data)
    value, errors = field.validate(data, {}, loc=("body",))
    if errors:
        raise RequestValidationError(errors, body=data)
    return value


class OffLoopBodyRoute(APIRoute):
    """An APIRoute whose JSON body, when large, is parsed and validated in a thread first; the
    app's `body_precheck(path, data)` (app.state), when set, sees it between the two."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        field = self.body_field
        if field is None or isinstance(field.field_info, params.Form):
            return handler

        async def parse_then_handle(request: Request) -> Response:
            if is_json(request.headers.get("content-type")):  # (a form's body is never read here)
                body = await request.body()
                if len(body) > OFF_LOOP_BYTES:
                    check = getattr(request.app.state, "body_precheck", None)
                    precheck = functools.partial(check, self.path) if check is not None else None
                    # Starlette's cache of request.json(), which FastAPI reads next
                    request._json = await asyncio.to_thread(parse_body, field, body, precheck)
            return await handler(request)

        return parse_then_handle
