"""OpenAI routes the gateway does not proxy, answered with what to do instead rather than a bare
route 404 ("Not Found: POST /v1/files"), which a LiteLLM proxy user (whose proxy routes files
and batches) read as a broken gateway or a wrong base_url.

The Batch API (/v1/files, /v1/batches) is not proxied: a batch would run outside the gateway's
per-request limits and spend, its files would be visible to every key, and its ids would have
to name the deployment holding them. Batches go to a `kvserve serve` backend directly."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request

from kvserve.gateway.errors import GatewayError

BATCH_API = ("/files", "/batches")
_METHODS = ["GET", "POST", "DELETE"]


def add_unsupported_routes(app: FastAPI, authenticate: Callable[[Request], Awaitable[object]]) -> None:
    """Each route, with and without /v1 and any sub-path: the key is checked first (401 as on
    every route), then 404 `unsupported_endpoint` saying so."""

    async def refuse(request: Request) -> None:
        await authenticate(request)
        raise GatewayError(
            404,
            f"{request.url.path}: the gateway does not proxy the Batch API (/v1/files, /v1/batches); "
            "send batch jobs to a kvserve serve backend directly (docs/GATEWAY.md)",
            code="unsupported_endpoint",
        )

    for base in BATCH_API:
        for path in (f"/v1{base}", base, f"/v1{base}/{{rest:path}}", f"{base}/{{rest:path}}"):
            app.add_api_route(path, refuse, methods=_METHODS, include_in_schema=False)
