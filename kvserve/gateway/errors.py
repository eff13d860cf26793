"""Gateway errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

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
