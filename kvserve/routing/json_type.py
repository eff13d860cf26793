"""A body sent as something other than JSON is refused by its Content-Type, as `kvserve serve`
(FastAPI) refuses it: `curl -d '{...}'` sends application/x-www-form-urlencoded, and the
gateway and the pd-proxy read such a body as JSON and served it where the backend's own server
answers 400."""

from __future__ import annotations

import email.message


def is_json(content_type: str) -> bool:
    """FastAPI's rule: application/json or application/*+json (parameters such as charset aside)."""
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    json_type = subtype == "json" or subtype.endswith("+json")
    return message.get_content_maintype() == "application" and json_type


def not_json(content_type: str | None) -> str | None:
    """The 400's message when a body's Content-Type is not JSON's, else None (none sent is read
    as JSON, as FastAPI reads it)."""
    if content_type and not is_json(content_type):
        why = "the body must be JSON sent with Content-Type: application/json"
        return f"{why} (this one had Content-Type {content_type!r})"
    return None
