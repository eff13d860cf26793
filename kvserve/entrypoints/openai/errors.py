"""OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi.responses import JSONResponse


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
