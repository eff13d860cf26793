"""Gateway errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

# error.code is a string everywhere (as kvserve serve answers): the default for each status
_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout",
}


def default_code(status: int) -> str:
    """The string code of an error that names none of its own."""
    return _CODES.get(status, "invalid_request" if status < 500 else "internal_error")


class GatewayError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code = code if code is not None else default_code(status)
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def unauthorized(message: str) -> GatewayError:
    return GatewayError(401, message, "authentication_error", "invalid_api_key")


def backend_error(content: bytes) -> dict | None:
    """A backend's answer's `error` object (OpenAI's shape), or None where it has none."""
    try:
        err = json.loads(content)["error"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    return err if isinstance(err, dict) else None


# OpenAI's 429 names the limit reached in its type ("requests", "tokens") with code
# rate_limit_exceeded; a spent budget is LiteLLM's budget_exceeded (type and code)
_LIMIT_TYPES = {"rpm": "requests", "parallel": "requests", "tpm": "tokens", "budget": "budget_exceeded"}


def limit_reached(message: str, kind: str, retry_after: int, headers: dict[str, str]) -> GatewayError:
    """The 429 of a key's, team's or deployments' limit of `kind` (rpm, tpm, parallel, budget)."""
    code = "budget_exceeded" if kind == "budget" else "rate_limit_exceeded"
    headers = {**headers, "retry-after": str(retry_after)}
    return GatewayError(429, message, _LIMIT_TYPES.get(kind, "requests"), code, headers=headers)


def upstream_rate_limited(message: str, content: bytes) -> GatewayError:
    """The 429 of a request every deployment answered 429: in OpenAI's shape, with the last
    backend's own type and code when it named them (an OpenAI backend's "tokens", a quota's
    insufficient_quota), else OpenAI's "requests" / rate_limit_exceeded (was type server_error,
    code upstream_error: a client reading the type took a busy backend for a broken one)."""
    type_, code = "requests", "rate_limit_exceeded"
    err = backend_error(content)
    if err is not None:
        type_ = err["type"] if isinstance(err.get("type"), str) and err["type"] else type_
        code = err["code"] if isinstance(err.get("code"), str) and err["code"] else code
    return GatewayError(429, message, type_, code)
