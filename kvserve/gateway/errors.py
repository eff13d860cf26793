"""Gateway errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class GatewayError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | int | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code = code if code is not None else status
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def unauthorized(message: str) -> GatewayError:
    return GatewayError(401, message, "authentication_error", "invalid_api_key")
