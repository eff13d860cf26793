"""Chat and completion handlers: OpenAI request -> engine streams -> OpenAI response.

Both endpoints fan a request out into one engine request per (prompt, sample) and merge
their streams, so n > 1 and lists of prompts share one code path. Streaming responses are
SSE `data: {...}` lines ending with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.engine.async_llm import AsyncLLM, EngineDeadError
from kvserve.entrypoints.openai.errors import error_response
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

_json = msgspec.json.Encoder()


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_names: list[str], request_timeout: float | None) -> None:
        self.engine = engine
        self.model_names = model_names
        self.request_timeout = request_timeout
        self.tokenizer = engine.tokenizer

    # ---- shared ----------------------------------------------------------------------------
    def validate(self, prompts: list, params: SamplingParams) -> None:
        """Check every prompt before starting anything: one bad prompt fails the whole request."""
        for p in prompts:
            self.engine.processor.process("validate", p, params)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise ValueError(
                f"model: {model!r} is not served here (available: {', '.join(self.model_names)})"
            )

    async def _merged(
        self, prompts: list, params: SamplingParams, n: int, rid: str
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) from every engine request of this API request, as they come."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, prompt, p: SamplingParams) -> None:
            try:
                async for out in self.engine.generate(prompt, p, f"{rid}-{index}"):
                    await queue.put((index, out))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await queue.put((index, e))
                return
            await queue.put((index, None))

        tasks = []
        for i, prompt in enumerate(prompts):
            for j in range(n):
                seed = None if params.seed is None else params.seed + j
                tasks.append(asyncio.create_task(pump(i * n + j, prompt, replace(params, seed=seed))))
        try:
            remaining = len(tasks)
            deadline = None if self.request_timeout is None else time.monotonic() + self.request_timeout
            while remaining:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    index, item = await asyncio.wait_for(queue.get(), timeout)
                except asyncio.TimeoutError:
                    raise TimeoutError(
                        f"request exceeded the server's request timeout ({self.request_timeout}s)"
                    ) from None
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _collect(self, gen, raw: Request) -> dict[int, RequestOutput]:
        """Drain a merged stream, aborting everything if the client disconnects."""
        finals: dict[int, RequestOutput] = {}

        async def consume() -> None:
            async for index, out in gen:
                finals[index] = out

        task = asyncio.create_task(consume())
        while not task.done():
            await asyncio.wait([task], timeout=0.5)
            if not task.done() and await raw.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise asyncio.CancelledError
        task.result()
        return finals

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], top: int) -> dict:
        content = []
        for tok, entry in zip(token_ids, logprobs):
            alts = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
            text = self._token_text(tok)
            content.append(
                {
                    "token": text,
                    "logprob": entry[tok],
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {"token": (t := self._token_text(a)), "logprob": lp, "bytes": list(t.encode())}
                        for a, lp in alts
                    ],
                }
            )
        return {"content": content}

    def _completion_logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float] | None], top: int, offset: int
    ) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tok, entry in zip(token_ids, logprobs):
            text = self._token_text(tok)
            tokens.append(text)
            token_lps.append(None if entry is None else entry[tok])
            if entry is None:
                tops.append(None)
            else:
                alts = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
                tops.append({self._token_text(a): lp for a, lp in alts})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    @staticmethod
    def _sse(obj: dict) -> bytes:
        return b"data: " + _json.encode(obj) + b"\n\n"

    # ---- chat ------------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, raw: Request):
        self.check_model(req.model)
        messages = [
            {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
            for m in req.messages
        ]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt
            )
        except ValueError:
            raise
        except Exception as e:  # template errors (e.g. roles it refuses) are the client's
            raise ValueError(f"messages: the chat template rejected them: {e}") from None
        prompt = self.tokenizer.encode(text, add_special_tokens=False)
        top = req.top_logprobs if req.top_logprobs is not None else 0
        if req.top_logprobs is not None and not req.logprobs:
            raise ValueError("top_logprobs: requires logprobs=true")
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = req.sampling_params(max_tokens, top if req.logprobs else None)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = req.model or self.model_names[0]
        self.validate([prompt], params)
        gen = self._merged([prompt], params, req.n, rid)
        if req.stream:
            return self._stream(gen, self._chat_chunks(gen, rid, created, model, req, len(prompt), top))
        finals = await self._collect(gen, raw)
        choices, completion_tokens = [], 0
        for i in range(req.n):
            c = finals[i].outputs[0]
            completion_tokens += len(c.token_ids)
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._chat_logprobs(c.token_ids, c.logprobs, top) if req.logprobs else None,
                    "finish_reason": c.finish_reason,
                }
            )
        return JSONResponse(
            {
                "id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": _usage(len(prompt), completion_tokens),
            }
        )  # fmt: skip

    async def _chat_chunks(
        self, gen, rid, created, model, req: ChatCompletionRequest, prompt_len: int, top: int
    ):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        extra = {"usage": None} if include_usage else {}
        for i in range(req.n):
            delta = {"role": "assistant", "content": ""}
            yield self._sse(
                {
                    **base,
                    "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}],
                    **extra,
                }
            )
        completion_tokens = 0
        async for index, out in gen:
            c = out.outputs[0]
            completion_tokens += len(c.delta_token_ids)
            if c.delta_text or c.delta_token_ids or out.finished:
                choice = {"index": index, "delta": {"content": c.delta_text} if c.delta_text else {}}
                choice["logprobs"] = (
                    self._chat_logprobs(c.delta_token_ids, c.logprobs[-len(c.delta_token_ids) :], top)
                    if req.logprobs and c.delta_token_ids
                    else None
                )
                choice["finish_reason"] = c.finish_reason if out.finished else None
                yield self._sse({**base, "choices": [choice], **extra})
        if include_usage:
            yield self._sse({**base, "choices": [], "usage": _usage(prompt_len, completion_tokens)})

    # ---- completions -----------------------------------------------------------------------
    def _prompts(self, prompt) -> list:
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt: must not be empty")
        if all(isinstance(p, int) for p in prompt):
            return [prompt]
        return list(prompt)

    async def completion(self, req: CompletionRequest, raw: Request):
        self.check_model(req.model)
        prompts = self._prompts(req.prompt)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        prompt_lp = req.logprobs if (req.echo and req.logprobs is not None) else None
        params = req.sampling_params(max_tokens, req.logprobs, prompt_lp)
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = req.model or self.model_names[0]
        self.validate(prompts, params)
        gen = self._merged(prompts, params, req.n, rid)
        if req.stream:
            return self._stream(gen, self._completion_chunks(gen, rid, created, model, req, prompts))
        finals = await self._collect(gen, raw)
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for index in sorted(finals):
            out = finals[index]
            c = out.outputs[0]
            if index % req.n == 0:
                prompt_tokens += len(out.prompt_token_ids)
            completion_tokens += len(c.token_ids)
            choices.append(
                {
                    "index": index, "text": self._echo_text(req, out) + c.text,
                    "logprobs": self._choice_logprobs(req, out), "finish_reason": c.finish_reason,
                }
            )  # fmt: skip
        return JSONResponse(
            {
                "id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": _usage(prompt_tokens, completion_tokens),
            }
        )  # fmt: skip

    def _echo_text(self, req: CompletionRequest, out: RequestOutput) -> str:
        if not req.echo:
            return ""
        return out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)

    def _choice_logprobs(self, req: CompletionRequest, out: RequestOutput) -> dict | None:
        if req.logprobs is None:
            return None
        c = out.outputs[0]
        if req.echo:
            ids = out.prompt_token_ids + c.token_ids
            lps = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + list(c.logprobs)
        else:
            ids, lps = c.token_ids, c.logprobs
        return self._completion_logprobs(ids, lps, req.logprobs, 0)

    async def _completion_chunks(self, gen, rid, created, model, req: CompletionRequest, prompts: list):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        base = {"id": rid, "object": "text_completion", "created": created, "model": model}
        extra = {"usage": None} if include_usage else {}
        prompt_tokens = completion_tokens = 0
        started: set[int] = set()
        async for index, out in gen:
            c = out.outputs[0]
            text = c.delta_text
            if index not in started:
                started.add(index)
                if index % req.n == 0:
                    prompt_tokens += len(out.prompt_token_ids)
                text = self._echo_text(req, out) + text
            completion_tokens += len(c.delta_token_ids)
            if text or out.finished:
                logprobs = None
                if req.logprobs is not None and c.delta_token_ids:
                    lps = c.logprobs[-len(c.delta_token_ids) :]
                    logprobs = self._completion_logprobs(c.delta_token_ids, lps, req.logprobs, 0)
                choice = {"index": index, "text": text, "logprobs": logprobs}
                choice["finish_reason"] = c.finish_reason if out.finished else None
                yield self._sse({**base, "choices": [choice], **extra})
        if include_usage:
            yield self._sse({**base, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})

    # ---- streaming ------------------------------------------------------------------------------
    def _stream(self, gen, chunks) -> StreamingResponse:
        async def body():
            try:
                async for chunk in chunks:
                    yield chunk
            except EngineDeadError as e:
                yield self._sse({"error": _err_body(str(e), "engine_dead", 503)})
            except TimeoutError as e:
                yield self._sse({"error": _err_body(str(e), "timeout", 504)})
            finally:
                await gen.aclose()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _err_body(message: str, type_: str, code: int) -> dict:
    return error_response(code, message, type_).body_dict
