"""`--root-path /prefix` (vLLM's, FastAPI's root_path): the server behind a reverse proxy that
serves it under a prefix. The prefix is taken off the request path before anything else reads
it, so a proxy that keeps it (`/prefix/v1/models`) and one that strips it (`/v1/models`) both
reach the routes, and the API-key gate, which matches paths, sees the same `/v1/...` path
either way: with FastAPI's own root_path `/prefix/v1/...` reached the routes but not the gate."""

from __future__ import annotations

import argparse

from starlette.types import ASGIApp, Receive, Scope, Send


def root_path(text: str) -> str:
    """A URL path prefix: starts with '/', no trailing '/' ('' and '/' are none)."""
    value = text.strip().rstrip("/")
    if value and (not value.startswith("/") or "?" in value or "#" in value or " " in value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL path prefix such as /api/llm")
    return value


class RootPath:
    """Strips the prefix from `path` / `raw_path` and records it as the ASGI root_path (links
    and /docs' OpenAPI `servers` carry it)."""

    def __init__(self, app: ASGIApp, prefix: str) -> None:
        self.app, self.prefix = app, prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            path, prefix = scope["path"], self.prefix
            if path == prefix or path.startswith(prefix + "/"):
                scope = {**scope, "path": path[len(prefix) :] or "/"}
                raw = scope.get("raw_path")
                if raw is not None and raw.startswith(prefix.encode()):
                    scope["raw_path"] = raw[len(prefix) :] or b"/"
            scope = {**scope, "root_path": scope.get("root_path", "") + prefix}
        await self.app(scope, receive, send)
