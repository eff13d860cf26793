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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from kvserve.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError, RequestStream
from kvserve.entrypoints.openai.errors import error_response
from kvserve.entrypoints.openai.lifecycle import ServerShuttingDownError
from kvserve.entrypoints.openai.limits import sample_seed
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from kvserve.entrypoints.openai.stall import StallWatch
from kvserve.entrypoints.openai.tool_parser import ToolCallStream, new_call_id, parse_calls
from kvserve.entrypoints.openai.tools import call_constraint, conversation, tool_mode
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

_json = msgspec.json.Encoder()


class ClientDisconnectedError(Exception):
    """The client went away before a non-streaming response was ready (its requests are aborted)."""


class ServerOverloadedError(RuntimeError):
    """Admission control refused the request (HTTP 503 with Retry-After)."""


def session_key(raw: Request, user: str | None) -> str | None:
    """The session a request belongs to, for session-affinity routing: `x-session-id`, else `user`."""
    return raw.headers.get("x-session-id") or user


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLM,
        model_names: list[str],
        request_timeout: float | None,
        max_waiting: int | None = None,
        stream_stall_timeout: float | None = None,
    ) -> None:
        self.max_waiting = max_waiting
        self.engine = engine
        self.model_names = model_names
        self.request_timeout = request_timeout
        self.stream_stall_timeout = stream_stall_timeout
        self.tokenizer = engine.tokenizer
        # Tokenizing and chat templating run here, off the event loop, so /health and the
        # streams keep their pace while a long prompt is being read (2 threads: 2 cores).
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvserve-tokenize")
        self.max_prompt_chars = engine.limits.max_model_len * self.tokenizer.max_token_chars

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- shared ----------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise ValueError(
                f"model: {model!r} is not served here (available: {', '.join(self.model_names)})"
            )

    def _check_chars(self, field: str, num_chars: int) -> None:
        """Refuse text that cannot fit max_model_len whatever it tokenizes to (before tokenizing)."""
        if num_chars > self.max_prompt_chars:
            raise ValueError(
                f"{field}: {num_chars} characters can never fit max_model_len="
                f"{self.engine.limits.max_model_len} tokens (at most {self.max_prompt_chars} characters)"
            )

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._check_chars("prompt", len(text))
        return await self._off_loop(self.tokenizer.encode, text, add_special_tokens)

    async def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool, template_kwargs: dict):
        """The chat template applied and tokenized, off the event loop."""
        self._check_chars("messages", sum(len(m.get("content") or "") for m in messages))

        def render() -> list[int]:
            try:
                text = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=add_generation_prompt, **template_kwargs
                )
            except ValueError:
                raise
            except Exception as e:  # template errors (e.g. roles it refuses) are the client's
                raise ValueError(f"messages: the chat template rejected them: {e}") from None
            return self.tokenizer.encode(text, add_special_tokens=False)

        return await self._off_loop(render)

    async def _start(
        self,
        prompts: list,
        params: SamplingParams,
        n: int,
        rid: str,
        priority: int,
        salt: str | None,
        session: str | None = None,
    ) -> list[RequestStream]:
        """Validate every prompt, apply admission control, then queue all engine requests of
        this API request at once (choice index = prompt index * n + sample index).

        One bad prompt fails the whole request before anything is queued; a request that could
        never be admitted is a 400; past max_waiting_requests the request is refused at once
        (503 + Retry-After). Queuing is all or nothing: if one engine request cannot be added,
        the ones already added are aborted.
        """
        seats = self.engine.config.max_num_seqs
        if n > seats:
            raise ValueError(f"n: {n} samples can never run at once here (max_num_seqs={seats})")
        total = len(prompts) * n
        if self.max_waiting is not None and total > self.max_waiting:
            raise ValueError(
                f"n: {total} sequences ({len(prompts)} prompt(s) x n={n}) exceed the waiting room "
                f"(max_waiting_requests={self.max_waiting}); this request could never be admitted"
            )
        ids = [await self.tokenize_text(p) if isinstance(p, str) else p for p in prompts]
        for p in ids:
            self.engine.processor.process("validate", p, params)
        if self.max_waiting is not None and self.engine.num_waiting + total > self.max_waiting:
            raise ServerOverloadedError(
                f"server busy: {self.engine.num_waiting} requests waiting (max_waiting_requests="
                f"{self.max_waiting}); retry later"
            )
        streams: list[RequestStream] = []
        try:
            for i, (prompt, prompt_ids) in enumerate(zip(prompts, ids)):
                group = f"{rid}-p{i}" if n > 1 else None  # the n samples share the prompt's KV blocks
                for j in range(n):
                    p = replace(params, seed=None if params.seed is None else sample_seed(params.seed, j))
                    streams.append(
                        self.engine.add_request(
                            prompt,
                            p,
                            f"{rid}-{i * n + j}",
                            priority,
                            salt,
                            group,
                            prompt_token_ids=prompt_ids,
                            session=session,
                        )
                    )
        except BaseException:
            for st in streams:
                await st.aclose()
            raise
        return streams

    def _deadline(self) -> float | None:
        return None if self.request_timeout is None else time.monotonic() + self.request_timeout

    async def _merged(
        self, streams: list[RequestStream], deadline: float | None
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) from every engine request of this API request, as they come.
        Closing it (client gone, timeout, error) aborts whatever has not finished."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    await queue.put((index, out))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await queue.put((index, e))
                return
            await queue.put((index, None))

        tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(streams)]
        try:
            remaining = len(tasks)
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
            for st in streams:
                await st.aclose()

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
                raise ClientDisconnectedError
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
        mode = tool_mode(req)
        messages, template_kwargs = conversation(req, self.tokenizer.hf.chat_template or "")
        prompt = await self.chat_prompt_ids(messages, req.add_generation_prompt, template_kwargs)
        top = req.top_logprobs if req.top_logprobs is not None else 0
        if req.top_logprobs is not None and not req.logprobs:
            raise ValueError("top_logprobs: requires logprobs=true")
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = req.sampling_params(max_tokens, top if req.logprobs else None)
        forced = call_constraint(req, mode)
        if forced is not None:
            params = replace(params, structured_outputs=forced)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = req.model or self.model_names[0]
        deadline = self._deadline()
        streams = await self._start(
            [prompt], params, req.n, rid, req.priority, req.cache_salt, session_key(raw, req.user)
        )
        gen = self._merged(streams, deadline)
        if req.stream:
            return self._stream(gen, self._chat_chunks(gen, rid, created, model, req, mode, top), streams)
        finals = await self._collect(gen, raw)
        choices, usage = [], Usage(req.n)
        for i in range(req.n):
            c = finals[i].outputs[0]
            usage.add(i, finals[i], len(c.token_ids))
            message, finish = self._chat_message(c.text, c.finish_reason, req, mode)
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": self._chat_logprobs(c.token_ids, c.logprobs, top) if req.logprobs else None,
                    "finish_reason": finish,
                }
            )
        return JSONResponse(
            {
                "id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage.as_dict(),
            }
        )  # fmt: skip

    @staticmethod
    def _chat_message(text: str, finish: str | None, req: ChatCompletionRequest, mode: str):
        """The assistant message (with tool_calls when the output holds calls) and finish_reason."""
        if mode == "none":
            return {"role": "assistant", "content": text}, finish
        content, calls = parse_calls(text, mode, _named(req))
        calls = calls if req.parallel_tool_calls else calls[:1]
        if not calls:
            return {"role": "assistant", "content": content}, finish
        tool_calls = [
            {"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
        message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
        return message, "tool_calls" if finish == "stop" else finish

    async def _chat_chunks(self, gen, rid, created, model, req: ChatCompletionRequest, mode: str, top: int):
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
        usage = Usage(req.n)
        tool_streams: dict[int, ToolCallStream] = {}
        async for index, out in gen:
            c = out.outputs[0]
            usage.add(index, out, len(c.delta_token_ids))
            with_logprobs = req.logprobs and c.delta_token_ids
            delta: dict = {"content": c.delta_text} if c.delta_text else {}
            finish = c.finish_reason if out.finished else None
            if mode != "none":  # tool calls: content and call deltas come from the parser
                ts = tool_streams.setdefault(
                    index, ToolCallStream(mode, _named(req), req.parallel_tool_calls)
                )
                content, calls = ts.feed(c.delta_text, out.finished)
                delta = {"content": content} if content else {}
                if calls:
                    delta["tool_calls"] = calls
                if finish == "stop" and ts.ids:
                    finish = "tool_calls"
            if delta or out.finished or with_logprobs:  # no empty chunks for held-back text
                choice = {"index": index, "delta": delta}
                choice["logprobs"] = (
                    self._chat_logprobs(c.delta_token_ids, c.delta_logprobs, top) if with_logprobs else None
                )
                choice["finish_reason"] = finish
                yield self._sse({**base, "choices": [choice], **extra})
        if include_usage:
            yield self._sse({**base, "choices": [], "usage": usage.as_dict()})

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
        deadline = self._deadline()
        streams = await self._start(
            prompts, params, req.n, rid, req.priority, req.cache_salt, session_key(raw, req.user)
        )
        gen = self._merged(streams, deadline)
        if req.stream:
            return self._stream(gen, self._completion_chunks(gen, rid, created, model, req, prompts), streams)
        finals = await self._collect(gen, raw)
        choices, usage = [], Usage(req.n)
        for index in sorted(finals):
            out = finals[index]
            c = out.outputs[0]
            usage.add(index, out, len(c.token_ids))
            choices.append(
                {
                    "index": index, "text": self._echo_text(req, out) + c.text,
                    "logprobs": self._choice_logprobs(req, out), "finish_reason": c.finish_reason,
                }
            )  # fmt: skip
        return JSONResponse(
            {
                "id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": usage.as_dict(),
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
        usage = Usage(req.n)
        offsets: dict[int, int] = {}  # characters sent so far per choice (for text_offset)
        async for index, out in gen:
            c = out.outputs[0]
            text, ids, lps = c.delta_text, list(c.delta_token_ids), list(c.delta_logprobs or [])
            if index not in offsets:
                offsets[index] = 0
                text = self._echo_text(req, out) + text
                if req.echo and req.logprobs is not None:  # the echoed prompt's logprobs come first
                    ids = out.prompt_token_ids + ids
                    lps = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + lps
            usage.add(index, out, len(c.delta_token_ids))
            with_logprobs = req.logprobs is not None and ids
            if text or out.finished or with_logprobs:
                logprobs = None
                if with_logprobs:
                    logprobs = self._completion_logprobs(ids, lps, req.logprobs, offsets[index])
                offsets[index] += len(text)
                choice = {"index": index, "text": text, "logprobs": logprobs}
                choice["finish_reason"] = c.finish_reason if out.finished else None
                yield self._sse({**base, "choices": [choice], **extra})
        if include_usage:
            yield self._sse({**base, "choices": [], "usage": usage.as_dict()})

    # ---- streaming ------------------------------------------------------------------------------
    def _stream(self, gen, chunks, streams: list[RequestStream]) -> StreamingResponse:
        async def abort_unfinished() -> None:
            # Runs after the response, also when the client went away mid-stream (Starlette
            # then stops iterating `body` without closing it, so its finally may never run).
            for st in streams:
                await st.aclose()

        async def body():
            stall = StallWatch(self.stream_stall_timeout, abort_unfinished)
            try:
                async for chunk in chunks:
                    stall.sending()
                    yield chunk
                    stall.sent()
            except EngineDeadError as e:
                yield self._sse({"error": _err_body(str(e), "engine_dead", 503)})
            except ServerShuttingDownError as e:
                yield self._sse({"error": _err_body(str(e), "server_shutting_down", 503)})
            except RequestFailedError as e:
                yield self._sse({"error": _err_body(str(e), "internal_error", 500)})
            except TimeoutError as e:
                yield self._sse({"error": _err_body(str(e), "timeout", 504)})
            finally:
                stall.stop()
                await gen.aclose()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(
            body(), media_type="text/event-stream", background=BackgroundTask(abort_unfinished)
        )


class Usage:
    """Token counts of one API request: each prompt counted once, every sample's output."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.prompt = self.completion = self.cached = 0
        self._seen: set[int] = set()

    def add(self, index: int, out: RequestOutput, new_tokens: int) -> None:
        if index not in self._seen:
            self._seen.add(index)
            if index % self.n == 0:
                self.prompt += len(out.prompt_token_ids)
                self.cached += out.num_cached_tokens
        self.completion += new_tokens

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt,
            "completion_tokens": self.completion,
            "total_tokens": self.prompt + self.completion,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        }


def _named(req: ChatCompletionRequest) -> str | None:
    return req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None


def _err_body(message: str, type_: str, code: int) -> dict:
    return error_response(code, message, type_).body_dict
