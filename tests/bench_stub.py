"""A stub OpenAI-compatible server with known timings, for checking `kvserve bench` against the truth.

Raw asyncio HTTP/1.1 (keep-alive, chunked SSE) so the stub itself costs almost nothing: every
streamed request sends its first token `--ttft-ms` after the request arrived and then one token
every `--itl-ms`, on an absolute schedule (no drift); 0/0 streams as fast as it can. Each
token is one SSE event with the text " tok" (with `n`, one per choice at the same moment); the
final event carries usage, counting every choice's tokens.

    python tests/bench_stub.py --port 8123 --ttft-ms 50 --itl-ms 10
"""

from __future__ import annotations

import argparse
import asyncio
import json

_COMPLETION = b'{"id":"cmpl-stub","object":"text_completion","created":0,"model":"stub","choices":[{"index":0,"text":" tok","logprobs":null,"finish_reason":null}]}'  # noqa: E501
_CHAT = b'{"id":"chatcmpl-stub","object":"chat.completion.chunk","created":0,"model":"stub","choices":[{"index":0,"delta":{"content":" tok"},"logprobs":null,"finish_reason":null}]}'  # noqa: E501


def _frame(payload: bytes) -> bytes:
    """One SSE event as one HTTP chunk."""
    data = b"data: " + payload + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _stream(writer: asyncio.StreamWriter, body: dict, chat: bool, ttft: float, itl: float) -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    n = int(body.get("max_tokens") or 16)
    choices = int(body.get("n") or 1)  # each token time, one event per choice (index 0, 1, ...)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    event = _CHAT if chat else _COMPLETION
    token = b"".join(_frame(event.replace(b'"index":0', b'"index":%d' % j)) for j in range(choices))
    for i in range(n):
        delay = t0 + ttft + i * itl - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        writer.write(token)
        if i % 64 == 63:
            await writer.drain()
    usage = {"prompt_tokens": 7, "completion_tokens": n * choices, "total_tokens": 7 + n * choices}
    if (body.get("stream_options") or {}).get("include_usage", True):  # as a server without it
        writer.write(_frame(json.dumps({"id": "stub", "choices": [], "usage": usage}).encode()))
    writer.write(_frame(b"[DONE]") + b"0\r\n\r\n")
    await writer.drain()


def _models(path: str) -> list[dict]:
    """/v1/models: one model ("stub-model"); under /several/ two, under /aliases/ two names of one
    (the same root, as kvserve's --served-model-name lists them). Under /locked/ every route is
    a 401; under /garbled/ a stream's events are JSON arrays, under /plain/ a stream is one JSON
    answer (a server ignoring stream: true)."""
    if "/several/" in path:
        return [{"id": "a", "object": "model", "root": "a"}, {"id": "b", "object": "model", "root": "b"}]
    if "/aliases/" in path:
        return [
            {"id": "first", "object": "model", "root": "r"},
            {"id": "second", "object": "model", "root": "r"},
        ]
    return [{"id": "stub-model", "object": "model"}]


async def _handle(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ttft: float, itl: float
) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            _method, path, _ = lines[0].split(" ", 2)
            headers = {
                k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)
            }
            size = int(headers.get("content-length", "0"))
            body = json.loads(await reader.readexactly(size)) if size else {}
            if "/locked/" in path:  # a server that wants an API key
                err = b'{"error":{"message":"Invalid API key","code":"invalid_api_key"}}'
                writer.write(b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\n")
                writer.write(b"content-length: %d\r\n\r\n%s" % (len(err), err))
                await writer.drain()
            elif "/plain/" in path and body.get("stream"):  # stream: true ignored, one JSON answer
                answer = b'{"id":"cmpl-plain","choices":[]}'
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
                writer.write(b"content-length: %d\r\n\r\n%s" % (len(answer), answer))
                await writer.drain()
            elif "/garbled/" in path and body.get("stream"):  # events that are JSON, not OpenAI's
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
                writer.write(b"transfer-encoding: chunked\r\n\r\n")
                writer.write(_frame(b"[1, 2]") + _frame(b"[DONE]") + b"0\r\n\r\n")
                await writer.drain()
            elif path.endswith("/completions") and body.get("stream"):
                await _stream(writer, body, path.endswith("/chat/completions"), ttft, itl)
            elif path.endswith("/v1/models"):
                models = json.dumps({"object": "list", "data": _models(path)}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
                writer.write(b"content-length: %d\r\n\r\n%s" % (len(models), models))
                await writer.drain()
            else:
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n{}"
                )
                await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def serve(port: int, ttft_ms: float, itl_ms: float) -> None:
    server = await asyncio.start_server(
        lambda r, w: _handle(r, w, ttft_ms / 1000, itl_ms / 1000), "127.0.0.1", port, backlog=512
    )
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ttft-ms", type=float, default=0.0)
    ap.add_argument("--itl-ms", type=float, default=0.0)
    a = ap.parse_args()
    asyncio.run(serve(a.port, a.ttft_ms, a.itl_ms))
