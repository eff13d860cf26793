"""The built-in web chat (`/`) and live dashboard (`/dashboard`), for `kvserve serve` and the
gateway alike.

Plain static files shipped inside the package (no build step, no CDN): the pages call only
their own origin (/v1/models, /v1/chat/completions, /metrics, /health/readiness), and the
Content-Security-Policy header makes the browser refuse anything else. The pages and their
assets need no API key; the API behind them does, and the pages ask for it when it answers 401.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; connect-src 'self'; img-src 'self' data:; style-src 'self'; "
        "script-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "Cache-Control": "no-cache",  # revalidate, so an upgraded server's pages are seen at once
}


class _Assets(StaticFiles):
    """StaticFiles with the pages' headers on every file (an HTML file opened under /ui/ too)."""

    def file_response(self, *args, **kwargs):
        response = super().file_response(*args, **kwargs)
        response.headers.update(_HEADERS)
        return response


def _page(name: str):
    async def page() -> FileResponse:
        return FileResponse(STATIC / name, media_type="text/html", headers=_HEADERS)

    return page


def add_web_ui(app: FastAPI) -> None:
    """Serve the chat at `/`, the dashboard at `/dashboard` and their assets under `/ui/`."""
    app.add_api_route("/", _page("chat.html"), methods=["GET"], include_in_schema=False)
    app.add_api_route("/dashboard", _page("dashboard.html"), methods=["GET"], include_in_schema=False)
    app.mount("/ui", _Assets(directory=STATIC), name="web-ui")
