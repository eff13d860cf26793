"""Large JSON bodies are parsed and validated in a worker thread (body_parsing.py), with the
same errors FastAPI's own path gives a small body."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, field_validator

from kvserve.entrypoints.openai.body_parsing import OFF_LOOP_BYTES, OffLoopBodyRoute, decode
from kvserve.entrypoints.openai.protocol import CompletionRequest, EmbeddingRequest

pytestmark = pytest.mark.anyio


class Body(BaseModel):
    items: list[int]
    text: str = ""

    @field_validator("items")
    @classmethod
    def _note_thread(cls, v: list[int]) -> list[int]:
        seen.append(threading.get_ident())
        return v


seen: list[int] = []


def make_app() -> FastAPI:
    app = FastAPI()
    app.router.route_class = OffLoopBodyRoute

    @app.exception_handler(RequestValidationError)
    async def errors(request: Request, exc: RequestValidationError):
        return JSONResponse([{k: e[k] for k in ("type", "loc", "msg")} for e in exc.errors()], 400)

    @app.post("/b")
    async def post(body: Body):
        return {"n": len(body.items), "loop_thread": threading.get_ident()}

    return app


async def send(app: FastAPI, content: bytes, content_type: str = "application/json") -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        return await c.post("/b", content=content, headers={"content-type": content_type})


PAD = b" " * OFF_LOOP_BYTES  # JSON whitespace: the same body, past the threshold


async def test_a_large_body_is_validated_off_the_loop_and_a_small_one_on_it():
    app = make_app()
    seen.clear()
    small = await send(app, b'{"items": [1, 2]}')
    assert small.status_code == 200 and seen == [small.json()["loop_thread"]]
    seen.clear()
    large = await send(app, b'{"items": [1, 2, 3]}' + PAD)
    assert large.status_code == 200 and large.json()["n"] == 3
    assert len(seen) == 1 and seen[0] != large.json()["loop_thread"]  # validated once, in a thread


@pytest.mark.parametrize(
    "body",
    [
        b'{"items": [1, "x"]}',  # a field's error
        b'{"items": [1, 2,, 3]}',  # not JSON
        b"[1, 2]",  # JSON, not an object
        b'{"text": "a"}',  # a required field missing
    ],
)
async def test_a_large_body_gets_the_errors_a_small_one_does(body):
    app = make_app()
    small, large = await send(app, body), await send(app, body + PAD)
    assert small.status_code == large.status_code == 400
    assert small.json() == large.json()


async def test_a_body_not_sent_as_json_is_left_to_fastapi():
    r = await send(make_app(), b'{"items": [1]}' + PAD, "text/plain")
    assert r.status_code == 400 and r.json()[0]["loc"] == ["body"]


def test_a_prompt_of_token_ids_is_validated_as_ids_alone():
    """A union tried member by member checked 1.8 million ids as strings first, one error per id:
    0.5 s holding the GIL while every stream waited. The first element picks the one member."""
    ids = [1] * 100_000 + ["x"]
    for model, field in ((CompletionRequest, "prompt"), (EmbeddingRequest, "input")):
        with pytest.raises(ValueError) as e:
            model.model_validate({field: ids})
        assert e.value.error_count() == 1, e.value.error_count()  # was 200,003


@pytest.mark.parametrize(
    "body",
    [
        b'{"a": [1, 2.5, "\\u00e9\\ud83d\\ude00", null, true, -0.0, 1e-400]}',
        b'{"a": NaN, "b": -Infinity, "c": 1e400}',  # json.loads' extensions, which msgspec refuses
        b'{"a": "\\ud800"}',  # a lone surrogate (a 400 later, naming the field)
        b'\xef\xbb\xbf{"a": 1}',  # a byte-order mark
        b'{"a": 1, "a": 2}',
        b'{"a": ' + b"9" * 5000 + b"}",  # past Python's digit limit: json's ValueError
        b"[" * 100_000 + b"]" * 100_000,  # json's RecursionError
        b'{"a": "\xe9"}',  # not UTF-8
        b'{"a": 1,}',
    ],
)
def test_the_decoder_gives_what_json_loads_gives(body):
    """msgspec decodes large bodies (about 0.6x json.loads' hold on the GIL); where it refuses a
    document, json.loads decides, so every body gets the answer or the error it had."""
    try:
        expected = repr(json.loads(body))
    except (ValueError, RecursionError) as e:
        with pytest.raises(type(e)):
            decode(body)
        return
    assert repr(decode(body)) == expected


def test_a_large_array_of_objects_is_decoded_letting_other_threads_run():
    """One decode of 300,000 messages was one C call holding the GIL (0.1 s idle, 4 s on a busy
    machine, the GC passes it sets off included): the event loop, and every stream, waited for
    all of it. Its elements are decoded one at a time now, and another thread runs between."""
    parts = [{"type": "text", "text": "hello there"}] * 37
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": parts}] * 8_000}).encode()
    decoding, ticks = threading.Event(), []

    def tick() -> None:
        decoding.wait()
        while decoding.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0005)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        decoding.set()
        time.sleep(0.01)  # the ticker is running from here
        start = time.perf_counter()
        data = decode(body)
        end = time.perf_counter()
    finally:
        decoding.clear()
        ticker.join()
    assert data == json.loads(body)
    during = [t for t in ticks if start < t < end]
    assert len(during) >= 10, (len(during), end - start)  # the whole decode at once: none
