"""The naive baseline: a web server calling transformers `model.generate()` per request.

This is what serving looks like without an engine: one request at a time (an asyncio lock),
generation in a worker thread, streaming through `TextIteratorStreamer`. It speaks the same
OpenAI subset as `kvserve serve` so `kvserve bench` can measure both on the same model; it
exists to be measured against, not to be used.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import torch
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from kvserve.entrypoints.sse_json import sse_json

logger = logging.getLogger("kvserve.naive")


class _Options(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")  # a baseline: unknown knobs are simply not honoured
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: _Options | None = None
    ignore_eos: bool = False


class CompletionBody(_Common):
    prompt: str | list[int]


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | None = None


class ChatBody(_Common):
    messages: Annotated[list[_Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = {"message": message, "type": "invalid_request_error", "param": param, "code": status}
    return JSONResponse({"error": body}, status_code=status)


def load_hf_model(model: str):
    """transformers' model for an alias / GGUF file (dequantized, fp32) or an HF directory, and
    kvserve's tokenizer for it (so both servers tokenize prompts identically)."""
    from transformers import AutoModelForCausalLM

    from kvserve.model.loader import load_tokenizer, resolve_model

    source = resolve_model(model)
    if source.kind == "gguf":
        d, f = os.path.split(source.path)
        hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32)
    return hf.eval(), load_tokenizer(source), source.name


class _Cancelled:
    """A stopping criterion that ends generation once the client has gone away."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool)


class NaiveGenerator:
    """One `generate()` call at a time; each runs in a worker thread so the event loop stays free."""

    def __init__(self, model, tokenizer) -> None:
        self.model, self.tok = model, tokenizer
        self.lock = asyncio.Lock()
        self.max_len = int(getattr(model.config, "max_position_embeddings", 2048))

    def _kwargs(self, body: _Common, prompt_len: int, max_tokens: int | None) -> dict[str, Any]:
        room = self.max_len - prompt_len
        if room < 1:
            raise ValueError(f"prompt: {prompt_len} tokens leave no room in the {self.max_len}-token context")
        n = min(max_tokens or room, room)
        eos = self.tok.eos_token_id
        kw: dict[str, Any] = {
            "max_new_tokens": n,
            "pad_token_id": eos if eos is not None else 0,
            "eos_token_id": eos,
        }
        if body.ignore_eos:
            kw["min_new_tokens"] = n
        temperature = 1.0 if body.temperature is None else body.temperature
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature, top_p=body.top_p or 1.0, top_k=0)
        else:
            kw["do_sample"] = False
        return kw

    @torch.inference_mode()
    def _generate(
        self, ids: list[int], kw: dict[str, Any], seed: int | None, streamer=None, stop=None
    ) -> list[int]:
        if seed is not None:
            torch.manual_seed(seed)
        x = torch.tensor([ids])
        try:
            out = self.model.generate(
                x, attention_mask=torch.ones_like(x), streamer=streamer,
                stopping_criteria=[stop] if stop else None, **kw,
            )  # fmt: skip
        except BaseException:
            if streamer is not None:
                streamer.end()  # unblock the reader
            raise
        return out[0, len(ids) :].tolist()

    async def complete(self, ids: list[int], body: _Common, max_tokens: int | None) -> tuple[str, list[int]]:
        kw = self._kwargs(body, len(ids), max_tokens)
        async with self.lock:
            new = await asyncio.to_thread(self._generate, ids, kw, body.seed)
        return self.tok.decode(new), new

    async def stream(
        self, ids: list[int], body: _Common, max_tokens: int | None
    ) -> AsyncIterator[str | list[int]]:
        """Yields text pieces as the streamer releases them, then the generated ids."""
        from transformers import TextIteratorStreamer

        kw = self._kwargs(body, len(ids), max_tokens)
        async with self.lock:
            streamer = TextIteratorStreamer(self.tok.hf, skip_prompt=True, skip_special_tokens=True)
            stop = _Cancelled()
            job = asyncio.ensure_future(asyncio.to_thread(self._generate, ids, kw, body.seed, streamer, stop))
            it = iter(streamer)
            try:
                while (piece := await asyncio.to_thread(next, it, None)) is not None:
                    if piece:
                        yield piece
                yield await job
            finally:
                stop.event.set()
                if not job.done():
                    await asyncio.wait([job])  # the lock is held until generation really stopped


def _sse(obj: dict) -> bytes:
    return b"data: " + sse_json(obj) + b"\n\n"


def build_naive_app(model, tokenizer, served_model_name: str) -> FastAPI:
    gen = NaiveGenerator(model, tokenizer)
    app = FastAPI(title="kvserve naive baseline")

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        return _error(
            400, f"{loc[0] if loc else 'body'}: {first.get('msg', 'invalid')}", loc[0] if loc else None
        )

    @app.exception_handler(ValueError)
    async def on_value_error(request, exc: ValueError):
        return _error(400, str(exc), str(exc).partition(":")[0] or None)

    def check_model(name: str | None) -> None:
        if name and name != served_model_name:
            raise ValueError(f"model: {name!r} is not served here (try {served_model_name!r})")

    def prompt_ids(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        if not prompt or any(not 0 <= t < tokenizer.vocab_size for t in prompt):
            raise ValueError(f"prompt: token ids must be non-empty and in [0, {tokenizer.vocab_size})")
        return list(prompt)

    def usage(p: int, c: int) -> dict[str, int]:
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def finish(n: int, max_tokens: int | None) -> str:
        return "length" if max_tokens is not None and n >= max_tokens else "stop"

    async def respond(ids: list[int], body: _Common, max_tokens: int | None, chat: bool):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        kind = "chat.completion" if chat else "text_completion"
        base = {"id": rid, "object": kind, "created": int(time.time()), "model": served_model_name}
        gen._kwargs(body, len(ids), max_tokens)  # validate before a stream starts
        if not body.stream:
            text, new = await gen.complete(ids, body, max_tokens)
            choice: dict[str, Any] = {
                "index": 0,
                "finish_reason": finish(len(new), max_tokens),
                "logprobs": None,
            }
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return JSONResponse({**base, "choices": [choice], "usage": usage(len(ids), len(new))})
        base["object"] += ".chunk" if chat else ""
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(text: str | None, reason: str | None) -> bytes:
            if chat:
                delta = {"content": text} if text is not None else {}
                c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            return _sse({**base, "choices": [c], **({"usage": None} if include_usage else {})})

        async def events():
            if chat:
                yield _sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})  # fmt: skip
            async for item in gen.stream(ids, body, max_tokens):
                if isinstance(item, str):
                    yield chunk(item, None)
                else:
                    yield chunk(None, finish(len(item), max_tokens))
                    if include_usage:
                        yield _sse({**base, "choices": [], "usage": usage(len(ids), len(item))})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        check_model(body.model)
        return await respond(prompt_ids(body.prompt), body, body.max_tokens or 16, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody):
        check_model(body.model)
        msgs = [{"role": m.role, "content": m.content or ""} for m in body.messages]
        ids = tokenizer.encode(tokenizer.apply_chat_template(msgs), add_special_tokens=False)
        return await respond(ids, body, body.max_completion_tokens or body.max_tokens, chat=True)

    @app.get("/v1/models")
    async def models():
        card = {"id": served_model_name, "object": "model", "created": int(time.time()), "owned_by": "naive",
                "max_model_len": gen.max_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    return app


def serve_naive(
    model: str,
    host: str,
    port: int,
    served_model_name: str | None,
    chat_template: str | None = None,
    uvicorn_log_level: str = "warning",
) -> int:
    """`kvserve serve --engine naive`: load the model in transformers and serve it (with serve's
    --chat-template and --uvicorn-log-level; cli.py refuses the flags it does not honour)."""
    import uvicorn

    hf, tok, name = load_hf_model(model)
    if chat_template is not None:
        tok.hf.chat_template = chat_template
    name = served_model_name or name
    logger.info("naive baseline: transformers generate(), one request at a time; serving %s on http://%s:%d",
                name, host, port)  # fmt: skip
    uvicorn.run(build_naive_app(hf, tok, name), host=host, port=port, log_level=uvicorn_log_level)
    return 0
