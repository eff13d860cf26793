"""The Batch API's routes at the gateway, with and without /v1 as LiteLLM's proxy serves them
(batches.py does the work). Each checks the key first (401 as on every route) and is refused
while draining, as the model routes are."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvserve.gateway.batch_ids import BATCH, FILE
from kvserve.gateway.batches import BatchAPI
from kvserve.gateway.keys import KeyRecord


def add_batch_routes(app: FastAPI, api: BatchAPI, admit: Callable[[Request], Awaitable[KeyRecord]]) -> None:
    """`admit`: the request's key, after the drain check."""

    def route(path: str, methods: list[str]):
        def add(fn):
            for p in (f"/v1{path}", path):
                app.add_api_route(p, fn, methods=methods, include_in_schema=False)
            return fn

        return add

    @route("/files", ["POST"])
    async def upload(request: Request) -> Response:
        return await api.upload(await admit(request), request)

    @route("/files", ["GET"])
    async def list_files(
        request: Request, limit: int = 10_000, after: str | None = None, purpose: str | None = None,
        order: Literal["asc", "desc"] = "desc",
    ) -> dict:  # fmt: skip
        return await api.listing(await admit(request), FILE, limit, after, purpose, order == "asc")

    @route("/files/{file_id}", ["GET", "DELETE"])
    async def file(request: Request, file_id: str) -> Response:
        return await api.file(await admit(request), request.method, file_id)

    @route("/files/{file_id}/content", ["GET"])
    async def content(request: Request, file_id: str) -> Response:
        return await api.file(await admit(request), "GET", file_id, "/content")

    @route("/batches", ["POST"])
    async def create(request: Request) -> Response:
        return await api.create(await admit(request), request)

    @route("/batches", ["GET"])
    async def list_batches(request: Request, limit: int = 20, after: str | None = None) -> dict:
        return await api.listing(await admit(request), BATCH, limit, after)

    @route("/batches/{batch_id}", ["GET"])
    async def batch(request: Request, batch_id: str) -> Response:
        return await api.batch(await admit(request), "GET", batch_id)

    @route("/batches/{batch_id}/cancel", ["POST"])
    async def cancel(request: Request, batch_id: str) -> Response:
        return await api.batch(await admit(request), "POST", batch_id, "/cancel")
