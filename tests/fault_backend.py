"""A small real OpenAI-compatible HTTP backend that misbehaves on request, for the gateway's
failure tests. The backend model name picks the behaviour:

    ok        answers (usage: prompt = words in the prompt, completion = max_tokens); a prefill
              request (kv_transfer_params.do_remote_decode) gets kv_transfer_params as a kv_producer's
    fail-500  500          fail-429  429 + Retry-After: 1      bad-400  a plain 400
    ctx-400   400 "maximum context length"                      hang     no first byte (60 s)
    die       streams 2 events, then drops the connection       slow     one event every 0.1 s
    hold-N    answers after N seconds                           crlf     as ok, SSE lines end in CRLF
    decode-hold-N  a prefill request (do_remote_decode) at once, any other as hold-N
    leased-PORT-MODE  a prefill request gets a `tcp` producer's parameters naming a lease
              (lease-1, lease-2, ...) at 127.0.0.1:PORT; any other request is answered as MODE
    ping-hang streams an SSE comment (": ping"), then nothing (60 s)
    stop-400  400 "stop: sequence too long" (a 400 about something else than the context)
    late-body not streamed: status and the first bytes of the JSON at once, the rest after 1 s
    no-total  as ok, its usage without total_tokens (prompt and completion tokens only)
    list-kv   as ok, but a prefill request is answered with a JSON list, not an object
    429-nan   429 + Retry-After: nan
    auth-401  401 invalid_api_key (as kvserve serve answers a wrong --api-key)
    unterminated  as ok, but a stream's last event (data: [DONE]) ends at the end of the body,
              without its blank line
    html-200  200 with an HTML page (a load balancer's maintenance page), not a JSON answer
    role-hang streams chat's opening chunk (the role, no content), then nothing (60 s)
    role-error streams chat's opening chunk, then an error event and [DONE] (as kvserve serve
              when its engine dies before the first token)
    role-refused as role-error, the error a 400 invalid_value (as kvserve serve streams a request its
              engine refused for its own parameters at output token 0)
    error-mid streams 2 events, then an engine_dead error event and [DONE] (as kvserve serve
              when its engine dies mid-answer)
    echo-keys not streamed: the answer's content is the JSON list of the body's field names
              (what reached the backend)

POST /v1/responses streams a Responses stream (created, two text deltas, completed); with model
"die" it drops the connection after the deltas. Not streamed, it answers a completed Response
whose metadata is the body's (what reached the backend).

Any model answers 400 (param temperature) to a temperature above 2, as a real backend would.
/tokenize, /detokenize, /version, /health and /health/ready answer as kvserve serve's would.
POST /v1/files takes an upload as a strict hosted API does: a form field other than OpenAI's
(purpose, file, expires_after[...]) is a 400 naming it; so is POST /v1/batches a field of its body.
POST /deny/v1/... answers 401 whatever the model (a server whose API key the caller lacks).
Any /busy/... answers 503 engine_dead + Retry-After: 5 (a server whose engine is restarting).
GET /stats gives requests per model and how many streams and holds the client cancelled.

    python tests/fault_backend.py --port 8124
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

app = FastAPI()
counts: Counter = Counter()
cancelled = {"streams": 0, "holds": 0}


def words(body: dict) -> int:
    """The backend's 'tokenizer': whitespace-separated words (so /tokenize and usage agree)."""
    if "messages" in body:
        return sum(len(str(m.get("content") or "").split()) for m in body["messages"])
    return len(str(body.get("prompt") or "").split())


def _chunk(chat: bool, text: str | None, finish: str | None = None) -> bytes:
    if chat:
        delta = {"content": text} if text is not None else {}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = {"id": "fault", "object": "chat.completion.chunk", "created": 0, "model": "fault"}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = {"id": "fault", "object": "text_completion", "created": 0, "model": "fault"}
    return b"data: " + json.dumps({**obj, "choices": [choice]}).encode() + b"\n\n"


def _usage(body: dict, n: int, mode: str) -> dict:
    usage = {"prompt_tokens": words(body), "completion_tokens": n, "total_tokens": words(body) + n}
    if mode == "no-total":
        del usage["total_tokens"]
    return usage


async def _events(body: dict, chat: bool, mode: str):
    n = int(body.get("max_tokens") or 4)
    try:
        for i in range(n):
            if mode == "slow":
                await asyncio.sleep(0.1)
            yield _chunk(chat, " tok")
            if mode == "die" and i == 1:
                raise ConnectionError("fault backend: dying mid-stream")
            if mode == "error-mid" and i == 1:
                err = {"message": "engine died", "type": "engine_dead", "param": None, "code": "engine_dead"}
                yield b"data: " + json.dumps({"error": err}).encode() + b"\n\ndata: [DONE]\n\n"
                return
        yield _chunk(chat, None, "length")
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = _usage(body, n, mode)
            yield b"data: " + json.dumps({"id": "fault", "choices": [], "usage": usage}).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    except asyncio.CancelledError:
        cancelled["streams"] += 1
        raise


async def _late_body(chat: bool):
    text = {"role": "assistant", "content": " tok"} if chat else " tok"
    choice = {"index": 0, "finish_reason": "length", **({"message": text} if chat else {"text": text})}
    answer = json.dumps({"id": "fault", "object": "chat.completion" if chat else "text_completion",
                         "created": 0, "model": "late-body", "choices": [choice]})  # fmt: skip
    yield answer[:10].encode()
    await asyncio.sleep(1)
    yield answer[10:].encode()


async def _ping_then_hang():
    yield b": ping\n\n"
    await asyncio.sleep(60)
    yield b"data: [DONE]\n\n"


async def _role_then(what: str):
    opening = {"id": "fault", "object": "chat.completion.chunk", "created": 0, "model": "fault",
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}]}  # fmt: skip
    yield b"data: " + json.dumps(opening).encode() + b"\n\n"
    if what == "hang":
        await asyncio.sleep(60)
    err = {"error": {"message": "engine died", "type": "engine_dead", "param": None, "code": "engine_dead"}}
    if what == "refused":  # the request's own parameters, as kvserve serve streams its 400
        err = {"error": {"message": "allowed_token_ids: none allowed", "type": "invalid_request_error",
                         "param": "allowed_token_ids", "code": "invalid_value"}}  # fmt: skip
    yield b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"


async def _answer(request: Request, chat: bool):
    body = await request.json()
    mode = str(body.get("model"))
    counts[mode] += 1
    kv = body.get("kv_transfer_params")
    prefill = isinstance(kv, dict) and kv.get("do_remote_decode")
    if mode.startswith("leased-"):  # leased-PORT-MODE: a producer's lease on 127.0.0.1:PORT, else MODE
        _, port, mode = mode.split("-", 2)
        if prefill and not body.get("stream"):
            counts["leases"] += 1
            params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": int(port),
                      "remote_request_id": f"lease-{counts['leases']}", "remote_num_tokens": 1,
                      "prompt_digest": "0" * 32, "kv_connector": "tcp"}  # fmt: skip
            return {"id": "fault", "object": "text_completion", "created": 0, "model": mode, "choices": [],
                    "kv_transfer_params": params}  # fmt: skip
    temperature = body.get("temperature")
    if isinstance(temperature, (int, float)) and temperature > 2:  # any mode: the request's mistake
        err = {"message": "temperature: must be <= 2", "param": "temperature", "code": "invalid_value"}
        return JSONResponse({"error": err}, 400)
    if mode == "echo-keys":
        choice = {"index": 0, "message": {"role": "assistant", "content": json.dumps(sorted(body))},
                  "finish_reason": "stop"}  # fmt: skip
        return {"id": "fault", "object": "chat.completion", "created": 0, "model": mode, "choices": [choice],
                "usage": _usage(body, 1, mode)}  # fmt: skip
    if mode == "fail-500":
        return JSONResponse({"error": {"message": "injected failure", "type": "server_error"}}, 500)
    if mode == "fail-429":
        return JSONResponse({"error": {"message": "slow down"}}, 429, headers={"retry-after": "1"})
    if mode == "auth-401":
        err = {"message": "invalid or missing API key", "code": "invalid_api_key"}
        return JSONResponse({"error": err}, 401)
    if mode == "429-nan":
        return JSONResponse({"error": {"message": "slow down"}}, 429, headers={"retry-after": "nan"})
    if mode == "bad-400":
        return JSONResponse({"error": {"message": "temperature: must be <= 2", "param": "temperature"}}, 400)
    if mode == "stop-400":
        msg = "stop: each sequence must be at most 64 characters; this one is too long"
        return JSONResponse({"error": {"message": msg, "param": "stop", "code": "invalid_value"}}, 400)
    if mode == "ctx-400":
        msg = "This model's maximum context length is 8 tokens; your prompt is longer"
        return JSONResponse({"error": {"message": msg, "code": "context_length_exceeded"}}, 400)
    if mode == "hang":
        await asyncio.sleep(60)
    if mode == "html-200":
        return HTMLResponse("<html><body>Down for maintenance</body></html>")
    if mode == "late-body" and not body.get("stream"):
        return StreamingResponse(_late_body(chat), media_type="application/json")
    if mode == "ping-hang" and body.get("stream"):
        return StreamingResponse(_ping_then_hang(), media_type="text/event-stream")
    if mode in ("role-hang", "role-error", "role-refused") and body.get("stream"):
        return StreamingResponse(_role_then(mode[5:]), media_type="text/event-stream")
    kv = body.get("kv_transfer_params")
    prefill = isinstance(kv, dict) and kv.get("do_remote_decode")
    if mode.startswith("decode-hold-") and not prefill:  # a prefill at once, the decode held
        mode = mode.removeprefix("decode-")
    if mode.startswith("hold-"):  # answer after N seconds unless the client leaves first
        loop = asyncio.get_running_loop()
        end = loop.time() + float(mode[5:])
        while loop.time() < end:
            if await request.is_disconnected():
                cancelled["holds"] += 1
                return JSONResponse({}, 499)
            await asyncio.sleep(0.05)
    if body.get("stream"):
        events = _events(body, chat, mode)
        if mode == "crlf":  # as sse-starlette writes them (its default separator)
            events = (e.replace(b"\n", b"\r\n") async for e in events)
        if mode == "unterminated":
            events = (e.removesuffix(b"\n\n") if e == b"data: [DONE]\n\n" else e async for e in events)
        return StreamingResponse(events, media_type="text/event-stream")
    n = int(body.get("max_tokens") or 4)
    usage = _usage(body, n, mode)
    text = " tok" * n
    kv = body.get("kv_transfer_params")
    if isinstance(kv, dict) and kv.get("do_remote_decode") and mode == "list-kv":
        return JSONResponse([{"kv_transfer_params": {"do_remote_prefill": True}}])
    if isinstance(kv, dict) and kv.get("do_remote_decode"):  # a prefill request: answer as a kv_producer
        return {"id": "fault", "object": "text_completion", "created": 0, "model": mode, "choices": [],
                "kv_transfer_params": {"do_remote_prefill": True, "remote_request_id": "fault"}}  # fmt: skip
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
    else:
        choice = {"index": 0, "text": text, "finish_reason": "length"}
    return {"id": "fault", "object": "chat.completion" if chat else "text_completion", "created": 0,
            "model": mode, "choices": [choice], "usage": usage}  # fmt: skip


@app.post("/deny/v1/chat/completions")
@app.post("/deny/v1/completions")
@app.get("/deny/v1/models")
async def deny():
    """A server whose --api-key the caller does not have (as kvserve serve answers it)."""
    return JSONResponse({"error": {"message": "invalid or missing API key", "code": "invalid_api_key"}}, 401)


@app.api_route("/busy/{path:path}", methods=["GET", "POST"])
async def busy():
    """A server whose engine is restarting (as kvserve serve answers any route meanwhile)."""
    err = {"message": "the engine core process died; it is restarting", "type": "engine_dead", "param": None,
           "code": "engine_dead"}  # fmt: skip
    return JSONResponse({"error": err}, 503, headers={"retry-after": "5"})


@app.post("/v1/chat/completions")
async def chat(request: Request):
    return await _answer(request, True)


@app.post("/v1/completions")
async def completions(request: Request):
    return await _answer(request, False)


async def _response_events(mode: str):
    resp = {"id": "resp_fault", "object": "response", "status": "in_progress", "model": mode, "output": []}
    events = [{"type": "response.created", "response": resp}]
    events += [{"type": "response.output_text.delta", "item_id": "msg_fault", "output_index": 0,
                "content_index": 0, "delta": " tok"} for _ in range(2)]  # fmt: skip
    usage = {"input_tokens": 1, "output_tokens": 2, "total_tokens": 3}
    events.append({"type": "response.completed", "response": {**resp, "status": "completed", "usage": usage}})
    for i, ev in enumerate(events):
        if mode == "die" and ev["type"] == "response.completed":
            raise ConnectionError("fault backend: dying mid-stream")
        yield f"event: {ev['type']}\ndata: {json.dumps({**ev, 'sequence_number': i})}\n\n".encode()


@app.post("/v1/responses")
async def responses(request: Request):
    body = await request.json()
    mode = str(body.get("model"))
    counts[mode] += 1
    if not body.get("stream"):
        return {"id": "resp_fault", "object": "response", "status": "completed", "model": mode, "output": [],
                "metadata": body.get("metadata"), "usage": {"input_tokens": 1, "output_tokens": 0,
                                                            "total_tokens": 1}}  # fmt: skip
    return StreamingResponse(_response_events(mode), media_type="text/event-stream")


@app.post("/tokenize")
async def tokenize(request: Request):
    n = words(await request.json())
    return {"tokens": list(range(n)), "count": n, "max_model_len": 100000}


@app.post("/detokenize")
async def detokenize(request: Request):
    return {"prompt": " ".join("w" for _ in (await request.json()).get("tokens", []))}


@app.post("/v1/responses/{response_id}/cancel")
async def cancel(response_id: str):
    """As a server running background responses answers it (OpenAI's: the Response)."""
    return {"id": response_id, "object": "response", "status": "completed", "output": []}


@app.post("/v1/files")
async def upload(request: Request):
    form = await request.form()
    unknown = sorted(k for k in form if k.partition("[")[0] not in ("purpose", "file", "expires_after"))
    if unknown:
        err = {"message": f"Unrecognized request argument supplied: {unknown[0]}",
               "type": "invalid_request_error", "param": unknown[0], "code": None}  # fmt: skip
        return JSONResponse({"error": err}, status_code=400)
    return {"id": "file-fault", "object": "file", "bytes": len(await form["file"].read()), "created_at": 0,
            "filename": form["file"].filename, "purpose": form["purpose"], "status": "processed"}  # fmt: skip


@app.post("/v1/batches")
async def create_batch(request: Request):
    """As OpenAI's: a field it does not know is a 400 naming it."""
    body = await request.json()
    known = ("input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after")
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        err = {"message": f"Unrecognized request argument supplied: {unknown[0]}",
               "type": "invalid_request_error", "param": unknown[0], "code": None}  # fmt: skip
        return JSONResponse({"error": err}, status_code=400)
    return {"id": "batch_fault", "object": "batch", "endpoint": body["endpoint"], "status": "validating",
            "input_file_id": body["input_file_id"], "completion_window": body["completion_window"],
            "created_at": 0, "metadata": body.get("metadata")}  # fmt: skip


@app.get("/version")
async def version():
    return {"version": "fault"}


@app.get("/health/ready")
async def ready():
    return {"status": "ok"}


@app.get("/v1/models")
async def models():
    return {"object": "list", "data": [{"id": "ok", "object": "model"}]}


@app.get("/health")
async def health():
    return {"status": "ok"}


@app.get("/stats")
async def stats():
    return {
        "requests": dict(counts),
        "cancelled_streams": cancelled["streams"],
        "cancelled_holds": cancelled["holds"],
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args()
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning", access_log=False)
