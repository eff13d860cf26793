"""The routes of `kvserve serve` that a pd-proxy's client uses besides generation, answered by
the decode engines (they hold the model the client talks to): the model list, /tokenize and
/detokenize (the gateway counts a deployment's tokens with /tokenize), /version, readiness
(/health/ready: a Kubernetes probe of the proxy's pod), vLLM's /ping, and cancelling a stored
Response on the engine its id names. They were 404s through the proxy."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvserve.disagg.errors import error, unreachable
from kvserve.disagg.split import JSON_HEADER
from kvserve.routing.probe_deadline import within

ENGINE_GETS = ("/version",)
ENGINE_POSTS = ("/tokenize", "/detokenize")


_RELAYED = ("retry-after", "x-request-id")  # an engine's headers a client acts on


def _failed(status: int) -> bool:
    """An engine answer another decode engine may do better than: down, restarting, busy."""
    return status >= 500 or status in (408, 429)


async def first_decode(proxy, raw: Request, path: str) -> Response:
    """The answer of the first decode engine that can be reached and is not failing (each in
    turn); when none is, the last failure as it came (its Retry-After kept), else a 502. One
    engine restarting (503 engine_dead) answered for all: /tokenize and /v1/models failed while
    another decode engine served."""
    content = await raw.body() if raw.method == "POST" else None
    headers = {**proxy._headers(raw), **(JSON_HEADER if content is not None else {})}
    answer: Response | None = None
    for url in proxy.decode:
        try:
            resp = await proxy.client.request(raw.method, url + path, content=content, headers=headers)
        except httpx.HTTPError as e:
            answer = answer if answer is not None else unreachable(url, e)
            continue
        media = resp.headers.get("content-type", "application/json")
        kept = {k: resp.headers[k] for k in _RELAYED if k in resp.headers}
        if not _failed(resp.status_code):
            return Response(resp.content, status_code=resp.status_code, media_type=media, headers=kept)
        answer = Response(resp.content, status_code=resp.status_code, media_type=media, headers=kept)
    return answer


async def up(proxy, url: str, path: str) -> bool:
    """Whether the engine answers `path` 200, within the probe deadline (a hung engine out of
    several kept /health/ready 2 s, past a Kubernetes probe's 1 s: routing/probe_deadline.py)."""

    async def ask() -> bool:
        return (await proxy.client.get(url + path, timeout=2.0)).status_code == 200

    return await within(ask(), False)


def add_engine_routes(app: FastAPI, proxy) -> None:
    """The routes above, on the proxy's app (`proxy`: its PDProxy)."""
    for path in ENGINE_GETS:

        async def get(raw: Request, _path: str = path) -> Response:
            return await first_decode(proxy, raw, _path)

        app.add_api_route(path, get, methods=["GET"])
    for path in ENGINE_POSTS:

        async def post(raw: Request, _path: str = path) -> Response:
            return await first_decode(proxy, raw, _path)

        app.add_api_route(path, post, methods=["POST"])

    @app.get("/health/ready")
    async def ready() -> Response:
        """Ready when a decode engine is (a prefill engine down only costs time: see /health), and
        not while draining (a load balancer stops sending at once)."""
        if proxy.lifecycle.draining:
            return JSONResponse(
                error("not ready: draining", None, "server_error", "not_ready"), status_code=503
            )
        states = await asyncio.gather(*(up(proxy, u, "/health/ready") for u in proxy.decode))
        if any(states):
            return JSONResponse({"decode": list(states)})
        msg = f"not ready: none of the {len(states)} decode engines is ready"
        return JSONResponse(error(msg, None, "server_error", "not_ready"), status_code=503)

    async def batch_api(raw: Request) -> Response:
        """The Batch API is not proxied (its files and batches live on one engine, and a batch
        there needs no prefill split): a 404 saying so, where it was a route 404 ("Not Found:
        POST /v1/files") that reads as a wrong base_url."""
        msg = (
            f"{raw.url.path}: the pd-proxy does not proxy the Batch API (/v1/files, /v1/batches); "
            "send batch jobs to a decode engine directly (docs/DISAGGREGATION.md)"
        )
        return JSONResponse(error(msg, None, code="unsupported_endpoint"), status_code=404)

    for base in ("/v1/files", "/v1/batches"):
        for path in (base, base + "/{rest:path}"):
            app.add_api_route(path, batch_api, methods=["GET", "POST", "DELETE"], include_in_schema=False)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(raw: Request, response_id: str) -> Response:
        """Cancel a stored (background) response on the decode engine its id names."""
        return await proxy.stored.request(
            proxy.client, "POST", response_id, raw.url.query, proxy._headers(raw), "/cancel"
        )
