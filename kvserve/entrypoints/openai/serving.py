"""Chat and completion handlers: OpenAI request -> engine streams -> OpenAI response.

Both endpoints fan a request out into one engine request per (prompt, sample) and merge
their streams, so n > 1 and lists of prompts share one code path. Both also share the rest
of a request's life (_launch: name it and queue it; _body / _chunks: the finished or the
streamed envelope with its usage; respond: JSON or SSE): each endpoint only says how one
choice looks. Streaming responses are SSE `data: {...}` lines ending with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from kvserve.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    RequestFailedError,
    RequestRefusedError,
    RequestStream,
)
from kvserve.engine.processor import ContextLengthError
from kvserve.entrypoints.openai.compat import (
    ModelNotFoundError,
    continues_final_message,
    normalize_chat,
    normalize_completion,
)
from kvserve.entrypoints.openai.echo_only import engine_max_tokens, prompt_only
from kvserve.entrypoints.openai.errors import error_response, param_of, renamed_in_text
from kvserve.entrypoints.openai.fingerprint import system_fingerprint
from kvserve.entrypoints.openai.lifecycle import ServerShuttingDownError
from kvserve.entrypoints.openai.limits import (
    MAX_LOGPROBS,
    MAX_PROMPTS,
    check_fan_out,
    check_logprobs,
    sample_seed,
)
from kvserve.entrypoints.openai.message_count import check_message_count
from kvserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    NamedToolChoice,
    SamplingFields,
    TokenizeRequest,
)
from kvserve.entrypoints.openai.stall import StallWatch
from kvserve.entrypoints.openai.token_ids import StreamedTokenIds
from kvserve.entrypoints.openai.tool_parser import ToolCallStream, new_call_id, parse_calls
from kvserve.entrypoints.openai.tools import call_constraint, conversation, tool_mode
from kvserve.entrypoints.sse_json import sse_json
from kvserve.generation_defaults import capped_max_tokens, generation_defaults
from kvserve.kv_transfer.params import check_one_prompt
from kvserve.model.loader import load_arch
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer import lone_surrogate, template_call_parameters

RESERVED_TEMPLATE_KWARGS = template_call_parameters()


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
        max_logprobs: int = MAX_LOGPROBS,
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
        self.fingerprint = system_fingerprint(engine.config, engine.source)
        # The model's generation_config.json sampling values, for fields a request leaves unset
        self.sampling_defaults = generation_defaults(engine.source, engine.config.generation_config)
        # --max-logprobs, as vLLM's: -1 is the whole vocabulary, and no cap passes the vocabulary
        vocab = engine.limits.vocab_size
        self.max_logprobs = vocab if max_logprobs == -1 else min(max_logprobs, vocab)

    @functools.cached_property
    def embedding_width(self) -> int:
        """The model's hidden size: the length of its embeddings."""
        return load_arch(self.engine.source).hidden_size

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- shared ----------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise ModelNotFoundError(
                f"model: {model!r} does not exist here (available: {', '.join(self.model_names)})"
            )

    @staticmethod
    def response_id(prefix: str, request_id: str | None, raw: Request) -> tuple[str, str]:
        """(the response's id, the base of its engine request ids). The id's suffix is the body's
        request_id, else the X-Request-Id the middleware echoes (the client's or a fresh one);
        engine ids add a random part, so two requests sent with the same id never collide."""
        suffix = request_id or getattr(raw.state, "request_id", None) or uuid.uuid4().hex
        raw.state.request_id = suffix
        rid = f"{prefix}-{suffix}"
        return rid, f"{rid}-{secrets.token_hex(4)}"

    def _check_chars(self, field: str, num_chars: int) -> None:
        """Refuse text that cannot fit max_model_len whatever it tokenizes to (before tokenizing)."""
        if num_chars > self.max_prompt_chars:
            raise ContextLengthError(
                field, self.engine.limits.max_model_len,
                f"{num_chars} characters can never fit it (at most {self.max_prompt_chars} characters)",
            )  # fmt: skip

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def detokenize(self, ids: list[int]) -> str:
        """/detokenize's text, checked and decoded on the serving pool: a body may hold millions
        of ids, seconds of work that on the event loop would stall every other request."""
        return await self._off_loop(self._decode_ids, ids)

    def _decode_ids(self, ids: list[int]) -> str:
        vocab = self.engine.limits.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"tokens: ids must be in [0, {vocab})")
        return self.engine.tokenizer.decode(ids, skip_special_tokens=False)

    async def tokenize_text(
        self, text: str, add_special_tokens: bool = True, truncated: bool = False
    ) -> list[int]:
        """`truncated`: only the last tokens are kept (truncate_prompt_tokens), so a text longer
        than any context is no error; the body-size limit bounds it."""
        if not truncated:
            self._check_chars("prompt", len(text))
        return await self._off_loop(self._encode, "prompt", text, add_special_tokens)

    def _encode(self, field: str, text: str, add_special_tokens: bool) -> list[int]:
        """Tokenized, where a lone surrogate (valid JSON: "\\ud800", but no character) is the
        client's 400, not the tokenizer's TypeError."""
        at = lone_surrogate(text)
        if at is not None:
            raise ValueError(f"{field}: not valid Unicode: a lone surrogate ({text[at]!a}) at character {at}")
        return self.tokenizer.encode(text, add_special_tokens)

    async def render_chat(self, req: ChatCompletionRequest | TokenizeRequest) -> list[int]:
        """The prompt ids of a chat request: tools, developer role and assistant prefill applied
        (tools.py, compat.py), plus the client's chat_template_kwargs."""
        check_message_count("messages", len(req.messages), self.engine.limits.max_model_len)
        # every message checked and converted: for a long conversation, work the loop cannot wait on
        template = self.tokenizer.hf.chat_template or ""
        messages, template_kwargs = await self._off_loop(conversation, req, template)
        extra = dict(req.chat_template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & extra.keys())
        if reserved:
            raise ValueError(
                f"chat_template_kwargs: {', '.join(reserved)} cannot be set (a parameter of the server's "
                "template call, not a template variable)"
            )
        prefill = continues_final_message(req)
        if prefill:
            template_kwargs["continue_final_message"] = True
        cut = getattr(req, "truncate_prompt_tokens", None) is not None  # any length fits once cut
        # vLLM's add_special_tokens: a BOS on top of the template's, only when asked (/tokenize's
        # default true is its prompt's, so its messages count as the chat request's)
        special = req.add_special_tokens and "add_special_tokens" in req.model_fields_set
        return await self.chat_prompt_ids(
            messages, req.add_generation_prompt and not prefill, {**extra, **template_kwargs}, cut, special
        )

    async def chat_prompt_ids(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        template_kwargs: dict,
        cut: bool = False,
        add_special_tokens: bool = False,
    ):
        """The chat template applied and tokenized, off the event loop; `cut` (truncate_prompt_tokens
        set): no length is refused before tokenizing."""
        if not cut:
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
            # the contents fit, but their template's markup may not: 340,000 one-letter messages
            # render 10 MB, seconds of a core to tokenize into a certain context_length_exceeded
            if not cut:
                self._check_chars("messages", len(text))
            return self._encode("messages", text, add_special_tokens)

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
        background: bool = False,
        samples_field: str = "n",
        add_special_tokens: bool = True,
    ) -> list[RequestStream]:
        """Validate every prompt, apply admission control, then queue all engine requests of
        this API request at once (choice index = prompt index * n + sample index).

        One bad prompt fails the whole request before anything is queued; a request that could
        never be admitted is a 400; past max_waiting_requests the request is refused at once
        (503 + Retry-After). Queuing is all or nothing: if one engine request cannot be added,
        the ones already added are aborted. `samples_field` names what set `n` (n or best_of);
        `add_special_tokens`: text prompts get the tokenizer's BOS (vLLM's field, true by default).
        """
        total = len(prompts) * n
        # Batch lines (background) are outside the waiting room: the batch runner bounds them with
        # its window, and the scheduler runs them only when no interactive request waits.
        limited = self.max_waiting is not None and not background
        if limited and total > self.max_waiting:
            field = samples_field if n > 1 else "prompt"  # prompt: renamed input or messages by the endpoint
            raise ValueError(
                f"{field}: {total} sequences ({len(prompts)} prompt(s) x {samples_field}={n}) exceed the "
                f"waiting room (max_waiting_requests={self.max_waiting}); the request could never be admitted"
            )
        keep = params.truncate_prompt_tokens
        cut = keep is not None
        ids = [
            await self.tokenize_text(p, add_special_tokens, cut) if isinstance(p, str) else p for p in prompts
        ]
        if cut:  # the tokens kept are the prompt: echo and usage show what ran
            prompts = ids = [self.engine.processor.truncate(list(p), keep) for p in ids]
        for p in ids:
            self.engine.processor.process("validate", p, params)
        if limited and self.engine.num_waiting + total > self.max_waiting:
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
                    streams[-1].background = background
        except BaseException:
            for st in streams:
                await st.aclose()
            raise
        return streams

    def _max_tokens(self, requested: int | None) -> int | None:
        """The request's max_tokens under a --generation-config directory's cap (vLLM's)."""
        return capped_max_tokens(requested, self.sampling_defaults, self.engine.config.generation_config)

    def _deadline(self) -> float | None:
        return None if self.request_timeout is None else time.monotonic() + self.request_timeout

    async def _merged(
        self, streams: list[RequestStream], deadline: float | None
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) from every engine request of this API request, as they come.
        Closing it (client gone, timeout, error) aborts whatever has not finished. The deadline
        is one timer that interrupts the streams, not a wait per output: a streamed token's
        CPU in this process is taken from the engine's cores."""
        timer = None
        if deadline is not None:
            error = TimeoutError(f"request exceeded the server's request timeout ({self.request_timeout}s)")

            def expire() -> None:
                for st in streams:
                    st.interrupt(error)

            timer = asyncio.get_running_loop().call_later(max(0.0, deadline - time.monotonic()), expire)
        tasks: list[asyncio.Task] = []
        try:
            if len(streams) == 1:  # n = 1: read the stream itself
                async for out in streams[0]:
                    yield 0, out
                return
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(index: int, stream: RequestStream) -> None:
                try:
                    async for out in stream:
                        queue.put_nowait((index, out))
                except BaseException as e:  # noqa: BLE001 - handed to the consumer
                    queue.put_nowait((index, e))
                    return
                queue.put_nowait((index, None))

            tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(streams)]
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            if timer is not None:
                timer.cancel()
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
        try:
            while not task.done():
                await asyncio.wait([task], timeout=0.5)
                if not task.done() and await raw.is_disconnected():
                    raise ClientDisconnectedError
        except BaseException:  # the client gone, or this handler cancelled (a batch line's cancel)
            task.cancel()  # closes the streams: the engine stops them (else they ran to the end)
            await asyncio.gather(task, return_exceptions=True)
            raise
        task.result()
        return finals

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _token_name(self, token_id: int, as_ids: bool) -> str:
        """How logprobs name a token: its text, or "token_id:<id>" (return_tokens_as_token_ids)."""
        return f"token_id:{token_id}" if as_ids else self._token_text(token_id)

    def _chat_logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float]], top: int, as_ids: bool = False
    ) -> dict:
        content = []
        for tok, entry in zip(token_ids, logprobs):
            alts = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
            content.append(
                {
                    "token": self._token_name(tok, as_ids),
                    "logprob": entry[tok],
                    "bytes": list(self.tokenizer.token_bytes(tok)),
                    "top_logprobs": [
                        {
                            "token": self._token_name(a, as_ids),
                            "logprob": lp,
                            "bytes": list(self.tokenizer.token_bytes(a)),
                        }
                        for a, lp in alts
                    ],  # fmt: skip
                }
            )
        return {"content": content}

    def _completion_logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float] | None], top: int, offset: int,
        as_ids: bool = False,
    ) -> dict:  # fmt: skip
        tokens, token_lps, tops, offsets = [], [], [], []
        for tok, entry in zip(token_ids, logprobs):
            text = self._token_text(tok)
            tokens.append(self._token_name(tok, as_ids))
            token_lps.append(None if entry is None else entry[tok])
            if entry is None:
                tops.append(None)
            else:
                # the sampled token too, as OpenAI's legacy completions (up to logprobs + 1
                # entries) and vLLM's: outside the top it was missing, and logprobs=0 gave {}
                alts = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
                alts += [(tok, entry[tok])] if all(a != tok for a, _ in alts) else []
                tops.append({self._token_name(a, as_ids): lp for a, lp in alts})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _content_tokens(self, token_ids: list[int], text: str, skip_special: bool) -> int:
        """How many leading tokens make up `text`: the end-of-turn token and the tokens of a
        cut stop string produced no content, so their logprobs are not reported."""
        m = len(token_ids)
        while m > 0 and len(self.tokenizer.decode(token_ids[: m - 1], skip_special)) >= len(text):
            m -= 1
        return m

    def _prompt_logprobs(self, out: RequestOutput, top: int) -> list[dict | None]:
        """vLLM's prompt_logprobs: per prompt token (None for the first) the logprob, rank and
        text of the actual token and of the top alternatives, keyed by token id. The actual
        token's rank is the engine's count over the vocabulary (it was None outside the top)."""
        result: list[dict | None] = []
        own_ranks = out.prompt_logprob_ranks or []
        for j, entry in enumerate(out.prompt_logprobs or []):
            if entry is None:
                result.append(None)
                continue
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])
            rank = {t: i + 1 for i, (t, _) in enumerate(ranked[:top])}
            if j < len(own_ranks) and own_ranks[j] is not None:
                rank[out.prompt_token_ids[j]] = own_ranks[j]
            result.append(
                {str(t): {"logprob": lp, "rank": rank.get(t), "decoded_token": self._token_text(t)}
                 for t, lp in entry.items()}
            )  # fmt: skip
        return result

    @staticmethod
    def _sse(obj: dict) -> bytes:
        """One server-sent event; objects with a `type` (Responses API events) name their event."""
        head = b"event: " + obj["type"].encode() + b"\n" if "type" in obj else b""
        return head + b"data: " + sse_json(obj) + b"\n\n"

    # ---- one request's life, shared by chat and completions ---------------------------------
    async def _launch(
        self, prefix: str, req: SamplingFields, prompts: list, params: SamplingParams, raw: Request
    ) -> Launched:
        """Name the response, queue its engine requests and merge their streams."""
        check_fan_out(len(prompts), req.n, req.best_of, self.engine.config.max_num_seqs)
        try:
            check_one_prompt(params.kv_transfer_params, len(prompts))
        except ValueError:  # a consumer's refusal frees the producer's lease at once
            self.engine.processor.release_lease(params)
            raise
        samples = max(req.n, req.best_of or 0)  # best_of > n: rank them by cumulative logprob
        if samples > req.n and params.logprobs is None:
            params = replace(params, logprobs=0)  # the ranking needs them; the reply shows them only if asked
        rid, engine_rid = self.response_id(prefix, req.request_id, raw)
        created = int(time.time())
        model = req.model or self.model_names[0]
        deadline = self._deadline()
        session, batch_line = session_key(raw, req.user), getattr(raw.state, "batch_line", False)
        # (a chat prompt is token ids by now: its add_special_tokens went to the template's)
        streams = await self._start(
            prompts, params, samples, engine_rid, req.priority, req.cache_salt, session, batch_line,
            "best_of" if samples > req.n else "n", req.add_special_tokens,
        )  # fmt: skip
        gen = self._merged(streams, deadline)
        return Launched(rid, created, model, streams, gen, samples, self.fingerprint)

    async def _body(
        self, run: Launched, obj: str, n: int, raw: Request, choice
    ) -> tuple[dict, dict[int, RequestOutput]]:
        """The finished, non-streamed response (and the outputs it was made of): `choice(index,
        output)` for each choice, in order."""
        finals = await self._collect(run.gen, raw)
        usage = Usage(run.samples)
        for index in sorted(finals):  # every sample drawn is billed, as OpenAI bills best_of
            usage.add(index, finals[index], len(finals[index].outputs[0].token_ids))
        if run.samples > n:
            finals = _best(finals, run.samples, n)
        choices = [choice(index, finals[index]) for index in sorted(finals)]
        body = {**run.envelope(obj), "choices": choices, "usage": usage.as_dict()}
        transfer = [f.kv_transfer_params for f in finals.values() if f.kv_transfer_params]
        if transfer:  # a prefill engine's answer to do_remote_decode (n is 1 then)
            body["kv_transfer_params"] = transfer[0]
        return body, finals

    async def _chunks(
        self,
        run: Launched,
        obj: str,
        req: SamplingFields,
        choice,
        first: Sequence[dict] = (),
        prompt_tokens: int = 0,
        head: dict | None = None,
    ) -> AsyncIterator[dict]:
        """The streamed response: `first` choices, then `choice(index, output)` per engine
        output (None: nothing to send yet), each in a chunk with its usage field; the usage
        chunk last when asked (stream_options). `prompt_tokens`: the prompt's length as sent,
        which the `first` chunks' continuous usage reports (as vLLM's), no output having come;
        `head`: top-level fields of the `first` chunks (vLLM's prompt_token_ids)."""
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        base = run.envelope(obj)
        usage = Usage(req.n, prompt_tokens)
        for c in first:
            yield {**base, **(head or {}), "choices": [c], **usage.chunk_field(include_usage, continuous)}
        async for index, out in run.gen:
            usage.add(index, out, len(out.outputs[0].delta_token_ids))
            c = choice(index, out)
            if c is not None:
                yield {**base, "choices": [c], **usage.chunk_field(include_usage, continuous)}
        if include_usage:
            yield {**base, "choices": [], "usage": usage.as_dict()}

    def respond(self, run: Run):
        """The HTTP response of a started request: SSE when streaming, else JSON."""
        if run.chunks is None:
            resp = JSONResponse(run.body)
        else:
            resp = self.sse_response(run.gen, run.chunks, run.streams)
        if run.warnings:  # deprecation notices (compat.py)
            resp.headers["Warning"] = ", ".join(run.warnings)
        return resp

    # ---- chat ------------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, raw: Request):
        return self.respond(await self.chat_run(req, raw))

    async def chat_run(self, req: ChatCompletionRequest, raw: Request) -> Run:
        """Start a chat request: streaming, its chunks (dicts, for /v1/chat/completions or for
        another envelope such as the Responses API); otherwise the finished body."""
        self.check_model(req.model)
        warnings = normalize_chat(req)
        mode = tool_mode(req)
        prompt = await self.render_chat(req)
        top = req.top_logprobs if req.top_logprobs is not None else 0
        if req.top_logprobs is not None and not req.logprobs:
            raise ValueError("top_logprobs: requires logprobs=true")
        check_logprobs("top_logprobs", req.top_logprobs, self.max_logprobs)
        check_logprobs("prompt_logprobs", req.prompt_logprobs, self.max_logprobs)
        max_tokens = self._max_tokens(req.max_completion_tokens or req.max_tokens)
        echo = req.messages[-1].text() if req.echo and continues_final_message(req) else ""
        try:  # (SamplingParams checks the limit too: "min_tokens: must be <= max_tokens (2)")
            top_n = top if req.logprobs else None
            params = await self._off_loop(self._chat_params, req, mode, max_tokens, top_n)
            if params.truncate_prompt_tokens is not None:  # (checked by now) what runs, and is counted
                prompt = self.engine.processor.truncate(prompt, params.truncate_prompt_tokens)
            launched = await self._launch("chatcmpl", req, [prompt], params, raw)
        except ValueError as e:  # the shared checks name `prompt`; a chat request sent `messages`
            rename_field(e, "prompt", "messages")
            if req.max_completion_tokens:  # and `max_tokens`, for the limit that came from this field
                rename_field(e, "max_tokens", "max_completion_tokens", in_text=True)
            raise
        run = Run(launched.gen, launched.streams, warnings)
        if req.stream:
            run.chunks = self._chat_chunks(launched, req, mode, top, echo, prompt)
            return run
        as_ids = req.return_tokens_as_token_ids

        def choice(i: int, out: RequestOutput) -> dict:
            c = out.outputs[0]
            message, finish = self._chat_message(echo + c.text, c.finish_reason, req, mode)
            logprobs = None
            if req.logprobs:
                k = len(c.token_ids)
                if c.finish_reason == "stop":  # an end-of-turn token or a cut stop string ended it
                    k = self._content_tokens(c.token_ids, c.text, req.skip_special_tokens)
                logprobs = self._chat_logprobs(c.token_ids[:k], c.logprobs[:k], top, as_ids)
            ids = {"token_ids": list(c.token_ids)} if req.return_token_ids else {}
            return {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish,
                    "stop_reason": _stop_reason(c), **ids}  # fmt: skip

        run.body, finals = await self._body(launched, "chat.completion", req.n, raw, choice)
        if req.prompt_logprobs is not None:
            run.body["prompt_logprobs"] = self._prompt_logprobs(finals[0], req.prompt_logprobs)
        if req.return_token_ids:  # vLLM's: the prompt the model saw, after the template and any cut
            run.body["prompt_token_ids"] = list(finals[0].prompt_token_ids)
        return run

    def _chat_params(self, req: ChatCompletionRequest, mode: str, max_tokens: int | None, top: int | None):
        """The engine params, run on the serving pool: a schema, regex or grammar (the client's or
        the forced tool call's) is parsed and checked here, seconds for a large one."""
        params = req.sampling_params(max_tokens, top, req.prompt_logprobs, self.sampling_defaults)
        forced = call_constraint(req, mode)
        return params if forced is None else replace(params, structured_outputs=forced)

    @staticmethod
    def _chat_message(text: str, finish: str | None, req: ChatCompletionRequest, mode: str):
        """The assistant message (with tool_calls when the output holds calls) and finish_reason;
        a request in the legacy `functions` form gets its call back as `function_call`."""
        if mode == "none":
            return {"role": "assistant", "content": text}, finish
        content, calls = parse_calls(text, mode, _named(req), _declared(req), cut=finish == "length")
        calls = calls if req.parallel_tool_calls else calls[:1]
        if not calls:
            return {"role": "assistant", "content": content}, finish
        if req.functions is not None:
            call = {"name": calls[0].name, "arguments": calls[0].arguments}
            message = {"role": "assistant", "content": content, "function_call": call}
            return message, "function_call" if finish == "stop" else finish
        tool_calls = [
            {"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
        message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
        return message, _call_finish(finish, mode)

    def _chat_chunks(
        self, run: Launched, req: ChatCompletionRequest, mode: str, top: int, echo: str, prompt: list[int]
    ) -> AsyncIterator[dict]:
        first = [
            {
                "index": i,
                "delta": {"role": "assistant", "content": echo},
                "logprobs": None,
                "finish_reason": None,
                "stop_reason": None,
            }
            for i in range(req.n)
        ]
        legacy = req.functions is not None
        as_ids = req.return_tokens_as_token_ids
        tool_streams: dict[int, ToolCallStream] = {}
        sent: dict[int, int] = {}  # tokens whose logprobs went out, per choice
        token_ids = StreamedTokenIds()

        def choice(index: int, out: RequestOutput) -> dict | None:
            c = out.outputs[0]
            if req.return_token_ids:
                token_ids.add(index, out)
            lp_ids, lps = c.text_token_ids, c.text_logprobs  # in step with the text released
            if req.logprobs and out.finished and c.finish_reason == "stop":  # not the end-of-turn token
                keep = self._content_tokens(c.token_ids, c.text, req.skip_special_tokens) - sent.get(index, 0)
                lp_ids, lps = lp_ids[: max(0, keep)], lps[: max(0, keep)]
            sent[index] = sent.get(index, 0) + len(lp_ids)
            with_logprobs = req.logprobs and lp_ids
            delta: dict = {"content": c.delta_text} if c.delta_text else {}
            finish = c.finish_reason if out.finished else None
            if mode != "none":  # tool calls: content and call deltas come from the parser
                ts = tool_streams.setdefault(
                    index, ToolCallStream(mode, _named(req), req.parallel_tool_calls, _declared(req))
                )
                content, calls = ts.feed(c.delta_text, out.finished, cut=finish == "length")
                delta = {"content": content} if content else {}
                if calls and legacy:  # one call, as `function_call` deltas
                    first_call = [call["function"] for call in calls if call.get("index", 0) == 0]
                    if first_call:
                        delta["function_call"] = first_call[0]
                elif calls:
                    delta["tool_calls"] = calls
                if ts.ids:
                    finish = "function_call" if legacy and finish == "stop" else _call_finish(finish, mode)
            if not (delta or out.finished or with_logprobs or token_ids.pending(index)):
                return None  # no empty chunks for held-back text
            logprobs = self._chat_logprobs(lp_ids, lps, top, as_ids) if with_logprobs else None
            stop = _stop_reason(c) if out.finished else None
            ids = {"token_ids": token_ids.take(index)} if req.return_token_ids else {}
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                    "stop_reason": stop, **ids}  # fmt: skip

        head = {"prompt_token_ids": list(prompt)} if req.return_token_ids else None
        return self._chunks(run, "chat.completion.chunk", req, choice, first, len(prompt), head)

    # ---- embeddings ------------------------------------------------------------------------
    async def embeddings(self, req: EmbeddingRequest, raw: Request) -> dict:
        """Each input runs as a prefill-only engine request (SamplingParams.pooling), batched
        with whatever else is running; vectors come back L2-normalized, in input order."""
        self.check_model(req.model)
        width = self.embedding_width
        if req.dimensions is not None and req.dimensions != width:
            raise ValueError(f"dimensions: this model's embeddings have {width} dimensions (no truncation)")
        params = SamplingParams(
            temperature=0,
            max_tokens=1,
            pooling=req.pooling,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
        )
        _, engine_rid = self.response_id("embd", None, raw)
        try:
            inputs = self._prompts(req.input)
            if len(inputs) > MAX_PROMPTS:  # each is an engine request, held from the moment it is queued
                raise ValueError(f"input: {len(inputs)} inputs in one request; at most {MAX_PROMPTS}")
            background = getattr(raw.state, "batch_line", False)  # a batch's: outside the waiting room
            streams = await self._start(
                inputs, params, 1, engine_rid, req.priority, None, background=background
            )
        except ValueError as e:  # the shared checks name `prompt`; this endpoint's field is `input`
            rename_field(e, "prompt", "input")
            raise
        finals = await self._collect(self._merged(streams, self._deadline()), raw)
        data, prompt_tokens = [], 0
        for i in range(len(inputs)):
            vector = np.asarray(finals[i].embedding, dtype=np.float32)
            vector /= max(float(np.linalg.norm(vector)), 1e-12)
            prompt_tokens += len(finals[i].prompt_token_ids)
            value = (
                base64.b64encode(vector.astype("<f4").tobytes()).decode()  # as OpenAI: float32 LE
                if req.encoding_format == "base64"
                else vector.tolist()
            )
            data.append({"object": "embedding", "index": i, "embedding": value})
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
        return {"object": "list", "data": data, "model": req.model or self.model_names[0], "usage": usage}

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
        warnings = normalize_completion(req)
        check_logprobs("logprobs", req.logprobs, self.max_logprobs)
        check_logprobs("prompt_logprobs", req.prompt_logprobs, self.max_logprobs)
        prompts = self._prompts(req.prompt)
        max_tokens = self._max_tokens(16 if req.max_tokens is None else req.max_tokens)
        wanted = [req.prompt_logprobs, req.logprobs if req.echo else None]
        prompt_lp = max((k for k in wanted if k is not None), default=None)
        engine_max = engine_max_tokens(max_tokens, req.echo)  # 0: the prompt alone (echo_only.py)
        # off the loop: a schema, regex or grammar is parsed and checked (seconds for a large one)
        params = await self._off_loop(
            req.sampling_params, engine_max, req.logprobs, prompt_lp, self.sampling_defaults
        )
        launched = await self._launch("cmpl", req, prompts, params, raw)
        if max_tokens == 0:
            launched.gen = prompt_only(launched.gen)
        run = Run(launched.gen, launched.streams, warnings)
        if req.stream:
            run.chunks = self._completion_chunks(launched, req)
            return self.respond(run)

        def choice(index: int, out: RequestOutput) -> dict:
            c = out.outputs[0]
            choice = {
                "index": index, "text": self._echo_text(req, out) + c.text,
                "logprobs": self._choice_logprobs(req, out), "finish_reason": c.finish_reason,
                "stop_reason": _stop_reason(c),
            }  # fmt: skip
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._prompt_logprobs(out, req.prompt_logprobs)
            if req.return_token_ids:  # vLLM's: the prompt the model saw (cut, if cut), and the output
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
                choice["token_ids"] = list(c.token_ids)
            return choice

        run.body, _ = await self._body(launched, "text_completion", req.n, raw, choice)
        return self.respond(run)

    def _echo_text(self, req: CompletionRequest, out: RequestOutput) -> str:
        if not req.echo:
            return ""
        return out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)

    def _stop_string_cut(self, c, req: CompletionRequest) -> int | None:
        """How many of a completion's tokens make its text when a stop string cut it (the
        stop string's tokens are not the answer's, as OpenAI reports them); None otherwise. An
        end-of-text token keeps its logprob, as in OpenAI's legacy completions."""
        if c.finish_reason != "stop" or not isinstance(c.stop_reason, str):
            return None
        return self._content_tokens(c.token_ids, c.text, req.skip_special_tokens)

    def _choice_logprobs(self, req: CompletionRequest, out: RequestOutput) -> dict | None:
        if req.logprobs is None:
            return None
        c = out.outputs[0]
        cut = self._stop_string_cut(c, req)
        token_ids, logprobs = c.token_ids[:cut], list(c.logprobs)[:cut]
        if req.echo:
            ids = out.prompt_token_ids + token_ids
            lps = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + logprobs
        else:
            ids, lps = token_ids, logprobs
        return self._completion_logprobs(ids, lps, req.logprobs, 0, req.return_tokens_as_token_ids)

    def _completion_chunks(self, run: Launched, req: CompletionRequest) -> AsyncIterator[dict]:
        offsets: dict[int, int] = {}  # characters sent so far per choice (for text_offset)
        token_ids = StreamedTokenIds()

        def choice(index: int, out: RequestOutput) -> dict | None:
            c = out.outputs[0]
            first = index not in offsets
            if req.return_token_ids:
                token_ids.add(index, out)
            # Tokens go out with their text: none held back as a stop string's start, none cut.
            text, ids, lps = c.delta_text, list(c.text_token_ids), list(c.text_logprobs or [])
            if index not in offsets:
                offsets[index] = 0
                text = self._echo_text(req, out) + text
                if req.echo and req.logprobs is not None:  # the echoed prompt's logprobs come first
                    ids = out.prompt_token_ids + ids
                    lps = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + lps
            with_logprobs = req.logprobs is not None and ids
            unsent = req.return_token_ids and (first or token_ids.pending(index))  # prompt or output ids
            if not (text or out.finished or with_logprobs or unsent):
                return None
            logprobs = None
            if with_logprobs:
                logprobs = self._completion_logprobs(
                    ids, lps, req.logprobs, offsets[index], req.return_tokens_as_token_ids
                )
            offsets[index] += len(text)
            finish = c.finish_reason if out.finished else None
            stop = _stop_reason(c) if out.finished else None
            extra = {}
            if req.return_token_ids:  # the prompt's ids with the choice's first chunk, as vLLM's
                extra = {"prompt_token_ids": list(out.prompt_token_ids)} if first else {}
                extra["token_ids"] = token_ids.take(index)
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                    "stop_reason": stop, **extra}  # fmt: skip

        return self._chunks(run, "text_completion", req, choice)

    # ---- streaming ------------------------------------------------------------------------------
    def sse_response(
        self, gen, chunks, streams: list[RequestStream], responses_api: bool = False
    ) -> StreamingResponse:
        """Stream `chunks` (dicts) as server-sent events, ending with [DONE]; errors become an
        error event, and whatever has not finished is aborted when the response ends.
        `responses_api`: the Responses API's stream, as OpenAI sends it: no [DONE], and an
        error is its own numbered event ({"type": "error", "code", "message", ...}), which the
        official client hands to the caller as an event rather than raising."""

        async def abort_unfinished() -> None:
            # Runs after the response, also when the client went away mid-stream (Starlette
            # then stops iterating `body` without closing it, so its finally may never run).
            for st in streams:
                await st.aclose()

        sent = 0

        def error_event(message: str, type_: str, status: int, code: str) -> bytes:
            err = _err_body(message, type_, status, code)
            if responses_api:
                return self._sse({"type": "error", "code": err["code"], "message": err["message"],
                                  "param": err["param"], "sequence_number": sent})  # fmt: skip
            return self._sse({"error": err})

        async def body():
            nonlocal sent
            stall = StallWatch(self.stream_stall_timeout, abort_unfinished)
            try:
                async for chunk in chunks:
                    stall.sending()
                    yield self._sse(chunk)
                    sent += 1
                    stall.sent()
            except EngineDeadError as e:
                yield error_event(str(e), "engine_dead", 503, "engine_dead")
            except ServerShuttingDownError as e:
                yield error_event(str(e), "server_shutting_down", 503, "shutting_down")
            except RequestRefusedError as e:
                yield error_event(str(e), "invalid_request_error", 400, "invalid_value")
            except RequestFailedError as e:
                yield error_event(str(e), "internal_error", 500, "engine_error")
            except TimeoutError as e:
                yield error_event(str(e), "timeout", 504, "timeout")
            finally:
                stall.stop()
                await gen.aclose()
            if not responses_api:
                yield b"data: [DONE]\n\n"

        return StreamingResponse(
            body(), media_type="text/event-stream", background=BackgroundTask(abort_unfinished)
        )


@dataclass
class Launched:
    """An API request whose engine requests are queued: its merged stream and its envelope."""

    rid: str
    created: int
    model: str
    streams: list[RequestStream]
    gen: AsyncIterator[tuple[int, RequestOutput]]

    samples: int = 1
    """Engine requests per prompt: n, or best_of when larger."""

    fingerprint: str | None = None
    """The server's system_fingerprint (fingerprint.py)."""

    def envelope(self, obj: str) -> dict:
        """OpenAI's top-level fields; chat's also say the tier that served it (the one there is:
        "default", whatever tier the request asked for, as OpenAI reports the tier it used)."""
        env = {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
               "system_fingerprint": self.fingerprint}  # fmt: skip
        if obj.startswith("chat."):
            env["service_tier"] = "default"
        return env


@dataclass
class Run:
    """A started chat or completion request: its merged engine stream, and either the chunks
    to stream or the finished body (another envelope, e.g. the Responses API, may take either)."""

    gen: AsyncIterator
    streams: list[RequestStream]
    warnings: list[str]
    chunks: AsyncIterator[dict] | None = None
    body: dict | None = None


class Usage:
    """Token counts of one API request: each prompt counted once, every sample's output."""

    def __init__(self, n: int, expected_prompt: int = 0) -> None:
        self.n = n
        self.prompt = self.completion = self.cached = 0
        self.expected_prompt = expected_prompt  # reported until the engine's output counts it
        self._seen: set[int] = set()

    def add(self, index: int, out: RequestOutput, new_tokens: int) -> None:
        if index not in self._seen:
            self._seen.add(index)
            if index % self.n == 0:
                self.prompt += len(out.prompt_token_ids)
                self.cached += out.num_cached_tokens
        self.completion += new_tokens

    def chunk_field(self, include_usage: bool, continuous: bool) -> dict:
        """A stream chunk's `usage`: so far (continuous_usage_stats), null (include_usage: only
        the last chunk carries it), or absent."""
        if continuous:
            return {"usage": self.as_dict()}
        return {"usage": None} if include_usage else {}

    def as_dict(self) -> dict:
        prompt = self.prompt or self.expected_prompt  # (counted once its sample 0 has output)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion,
            "total_tokens": prompt + self.completion,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        }


def _call_finish(finish: str | None, mode: str) -> str | None:
    """A reply that called tools ends with "tool_calls", except a call forced by name, which ends
    with "stop" as OpenAI's does (vLLM matched it: its PR 25054); a length cut stays "length"."""
    return "tool_calls" if finish == "stop" and mode != "named" else finish


def _stop_reason(c) -> int | str | None:
    """vLLM's `stop_reason`: the stop string or stop token id that ended a choice, else null (an
    end-of-sequence token, the length limit; an error's message is not one)."""
    return c.stop_reason if c.finish_reason == "stop" else None


def _best(finals: dict[int, RequestOutput], samples: int, n: int) -> dict[int, RequestOutput]:
    """best_of: per prompt, the n samples of highest cumulative logprob, best first, re-indexed."""

    def score(out: RequestOutput) -> float:
        c = out.outputs[0]
        return sum(entry[tok] for tok, entry in zip(c.token_ids, c.logprobs or []))

    best: dict[int, RequestOutput] = {}
    for p in range(len(finals) // samples):
        ranked = sorted(range(p * samples, (p + 1) * samples), key=lambda i: -score(finals[i]))
        best.update({p * n + rank: finals[i] for rank, i in enumerate(ranked[:n])})
    return best


def _named(req: ChatCompletionRequest) -> str | None:
    return req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None


def _declared(req: ChatCompletionRequest) -> set[str]:
    """The tool names a call may have ("auto" leaves JSON naming any other as the answer)."""
    return {t.function.name for t in req.tools or []}


def _err_body(message: str, type_: str, status: int, code: str) -> dict:
    """An error event inside a stream: the body (and code) its non-streamed response would have
    (a 400's param: the field its message starts with)."""
    param = param_of(message) if status == 400 else None
    return error_response(status, message, type_, param, code=code).body_dict


def rename_field(e: ValueError, old: str, new: str, in_text: bool = False) -> None:
    """Rename, in place (its class, and so its error code, stay), the field an error starts
    with: the engine's checks name `prompt` whatever the endpoint called it. `in_text`: also
    wherever the message names it ("+ max_tokens (9000) exceed it", "lower max_tokens"), in
    another field's error too ("min_tokens: must be <= max_tokens (2)")."""
    head, sep, rest = str(e).partition(":")
    if sep and (head == old or in_text):
        e.args = (f"{new if head == old else head}:{renamed_in_text(rest, old, new) if in_text else rest}",)
