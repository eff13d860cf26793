"""A body sent as something other than JSON is refused by its Content-Type, as `kvserve serve`
(FastAPI) refuses it: `curl -d '{...}'` sends application/x-www-form-urlencoded, and the
gateway read such a body as JSON and served it where the backend's own server answers 400."""

from __future__ import annotations

import email.message

from starlette.requests import Request

from kvserve.gateway.errors import GatewayError


def is_json(content_type: str) -> bool:
    """FastAPI's rule: application/json or application/*+json (parameters such as charset aside)."""
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    json_type = subtype == "json" or subtype.endswith("+json")
    return message.get_content_maintype() == "application" and json_type


def require_json(request: Request) -> None:
    """A 400 naming the Content-Type sent when it is not JSON's; none sent is read as JSON (as
    FastAPI reads it)."""
    sent = request.headers.get("content-type")
    if sent and not is_json(sent):
        why = "the body must be JSON sent with Content-Type: application/json"
        raise GatewayError(400, f"{why} (this one had Content-Type {sent!r})", code="invalid_json")
