"""The gateway's refusal of a body not sent as JSON (routing/json_type.py), as a GatewayError."""

from __future__ import annotations

from starlette.requests import Request

from kvserve.gateway.errors import GatewayError
from kvserve.routing.json_type import not_json


def require_json(request: Request) -> None:
    """A 400 naming the Content-Type sent when it is not JSON's."""
    if (why := not_json(request.headers.get("content-type"))) is not None:
        raise GatewayError(400, why, code="invalid_json")
