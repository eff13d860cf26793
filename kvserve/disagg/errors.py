"""The pd-proxy's own errors, in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging

import httpx
from fastapi.responses import JSONResponse

logger = logging.getLogger("kvserve.disagg.proxy")


def error(
    message: str, param: str | None, type_: str = "invalid_request_error", code: str = "invalid_json"
) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def reason(e: BaseException) -> str:
    return f"{e.__class__.__name__}: {e}".strip(": ")


def unreachable(url: str, e: httpx.HTTPError, headers: dict | None = None) -> JSONResponse:
    """502 when an engine the proxy needs cannot be reached (was a bare 500 and a traceback)."""
    logger.warning("%s failed (%s)", url, reason(e))
    err = error(f"engine {url} is unreachable ({reason(e)})", None, "server_error", "upstream_error")
    return JSONResponse(err, status_code=502, headers=headers)
