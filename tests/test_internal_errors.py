"""An exception no route handler takes (kvserve's own bug) is answered in OpenAI's error shape,
and does not escape to the server (which would drop the client's keep-alive connection)."""

from __future__ import annotations

import asyncio
import logging

import httpx
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from kvserve.entrypoints.openai.middleware import InternalErrors


async def boom(request):
    raise RuntimeError("a bug")


async def boom_mid_stream(request):
    async def body():
        yield b"data: 1\n\n"
        raise RuntimeError("a bug after the headers")

    return StreamingResponse(body(), media_type="text/event-stream")


def test_a_bug_is_a_500_in_openai_shape_logged_once(caplog):
    app = Starlette(routes=[Route("/boom", boom), Route("/stream", boom_mid_stream)])
    app.add_middleware(InternalErrors)

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as client:
            r = await client.get("/boom")
            assert r.status_code == 500
            assert r.json()["error"]["type"] == "internal_error" and r.json()["error"]["param"] is None
            try:  # after the headers nothing can be answered: the exception goes on
                await client.get("/stream")
                raise AssertionError("the stream's exception was swallowed")
            except RuntimeError as e:
                assert "after the headers" in str(e)

    with caplog.at_level(logging.ERROR, logger="kvserve.server"):
        asyncio.run(run())
    logged = [r for r in caplog.records if "internal error" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None
