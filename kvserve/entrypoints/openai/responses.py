"""POST /v1/responses, GET / DELETE /v1/responses/{id}: the Responses API over the chat path.

Each response runs as a chat request (responses_protocol.to_chat); here its result is put in
the Responses envelope: output items (a message with output_text, function_call items),
usage in input/output tokens, and, streaming, the typed event sequence clients reassemble
(response.created, output_item.added, output_text.delta, ..., response.completed).
Stored responses (store=true, the default) keep their conversation so a later request can
continue it with previous_response_id, in a bounded store (response_store.py).
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.background import BackgroundTask, BackgroundTasks

from kvserve.engine.async_llm import RequestRefusedError
from kvserve.engine.processor import ContextLengthError
from kvserve.entrypoints.openai.errors import EmptyStringError, param_of, renamed_in_text
from kvserve.entrypoints.openai.protocol import DEFAULT_TEMPERATURE, DEFAULT_TOP_P
from kvserve.entrypoints.openai.response_store import (
    PreviousResponseNotFoundError,
    ResponseNotFoundError,
    ResponseStore,
)
from kvserve.entrypoints.openai.responses_ending import (
    STREAM_FAILURES,
    end_early,
    failure_code,
    response_error_code,
)
from kvserve.entrypoints.openai.responses_items import (
    chain_items,
    refuse_duplicates,
    resolved,
    stored_input_items,
)
from kvserve.entrypoints.openai.responses_live import LiveResponses
from kvserve.entrypoints.openai.responses_protocol import (
    ResponsesRequest,
    input_messages,
    refuse_unsupported,
    to_chat,
)
from kvserve.entrypoints.openai.serving import OpenAIServing, Run
from kvserve.request import BACKGROUND_PRIORITY

# The chat request's fields that a Responses request calls otherwise: an error raised on the
# chat path names the field this request sent (OpenAI's param), not the chat one.
_CHAT_TO_RESPONSES = {
    "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
    "response_format": "text", "messages": "input", "prompt": "input",
}  # fmt: skip


def _name_responses_fields(e: ValueError) -> None:
    """Rename, in place (so its class, and the error code it gives, stay), the chat field an
    error starts with, and the token limit wherever the text names it: 'max_tokens: ... need
    9 KV blocks ...; lower max_tokens' -> 'max_output_tokens: ...; lower max_output_tokens'
    (only "max_tokens (" was renamed in the text, so the advice named a field not sent)."""
    if e.args and isinstance(e.args[0], str):
        head, sep, rest = e.args[0].partition(":")
        if not sep:  # no field named first: the whole message is text
            head, rest = "", head
        head = _CHAT_TO_RESPONSES.get(head, head)
        for limit in ("max_tokens", "max_completion_tokens"):  # a Responses request has neither
            rest = renamed_in_text(rest, limit, "max_output_tokens")
        e.args = (f"{head}{sep}{rest}", *e.args[1:])


# what a response is stored with: the conversation before its output, and its input items
Given = tuple[list[dict], list[dict]]


def used(value: float | None, default: float) -> float:
    """A sampling value as the response echoes it: the one used, the default when unset (OpenAI's
    response shows 1.0 for a request without temperature; null said nothing was used)."""
    return default if value is None else value


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str, logprobs: list[dict] | None = None) -> dict:
    """`logprobs`: the chat path's per-token entries (token, logprob, bytes, top_logprobs), the
    shape the Responses API gives them too; [] unless the request set top_logprobs."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message_item(text: str | None, status: str = "completed", logprobs: list[dict] | None = None) -> dict:
    """A message item; text None gives the empty `content` that OpenAI's stream starts one with."""
    content = [] if text is None else [_text_part(text, logprobs)]
    return {"type": "message", "id": _new_id("msg"), "status": status, "role": "assistant",
            "content": content}  # fmt: skip


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": _new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


def _usage(chat_usage: dict | None) -> dict | None:
    if chat_usage is None:
        return None
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        # cache_write_tokens: the SDK's type requires it (OpenAI's explicit cache writes; none here)
        "input_tokens_details": {
            "cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,
        },
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def _close_items(output: list[dict], cut: bool) -> None:
    """Each item's final status: the one max_output_tokens cut (the last, when `cut`) is
    "incomplete", as OpenAI marks it; every item was "completed", a cut call's half-written
    arguments included. A last call whose arguments are whole JSON was not cut: the parser
    leaves out a call cut before its arguments began."""
    for i, item in enumerate(output):
        was_cut = cut and i == len(output) - 1 and not _whole_call(item)
        item["status"] = "incomplete" if was_cut else "completed"


def _whole_call(item: dict) -> bool:
    if item["type"] != "function_call":
        return False
    try:
        json.loads(item["arguments"])
    except ValueError:
        return False
    return True


def _assistant_turn(output: list[dict]) -> list[dict]:
    """The output items as chat messages, to carry into the next turn. A call cut off by
    max_output_tokens is left out: its arguments are no JSON (the next turn was refused as
    "input: tool_calls arguments are not valid JSON"), and it is no call to answer."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [
        {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
        for i in output
        if i["type"] == "function_call" and i["status"] != "incomplete"
    ]
    return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]


class ResponsesServing:
    def __init__(self, serving: OpenAIServing, store: ResponseStore) -> None:
        self.serving = serving
        self.store = store
        self.live = LiveResponses()  # stored streams still running (GET finds them in_progress)

    def retrieve(self, response_id: str) -> dict:
        """A stored response; one still streaming as it stands (in_progress), as OpenAI's GET."""
        live = self.live.snapshot(response_id)
        return live if live is not None else self.store.get(response_id)[0]

    def input_items(self, response_id: str) -> list[dict]:
        live = self.live.input_items(response_id)
        return live if live is not None else self.store.input_items(response_id)

    def delete(self, response_id: str) -> None:
        """A live one's stream goes on, but it is not stored when it ends."""
        if not self.live.delete(response_id):
            self.store.delete(response_id)

    def _skeleton(self, req: ResponsesRequest, rid: str, model: str) -> dict[str, Any]:
        defaults = self.serving.sampling_defaults
        return {
            "id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "model": model, "output": [], "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            # the values sampled with: an unset one is the model's default (generation_config.json)
            "temperature": used(req.temperature, defaults.get("temperature", DEFAULT_TEMPERATURE)),
            "top_p": used(req.top_p, defaults.get("top_p", DEFAULT_TOP_P)),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            # null failed the SDK's Response type, which requires it: OpenAI's default, "auto"
            "tool_choice": req.tool_choice if isinstance(req.tool_choice, str)
            else "auto" if req.tool_choice is None else req.tool_choice.model_dump(),
            "parallel_tool_calls": req.parallel_tool_calls, "max_tool_calls": req.max_tool_calls,
            "previous_response_id": req.previous_response_id,
            "text": {"format": (req.text.format.model_dump(by_alias=True, exclude_none=True)
                                if req.text and req.text.format else {"type": "text"})},
            "metadata": req.metadata or {}, "store": req.store, "truncation": req.truncation or "disabled",
            "error": None, "incomplete_details": None, "usage": None, "completed_at": None,
            "service_tier": "default",  # the tier that served it, as chat completions say
            # the request's own values, as OpenAI echoes them (an SDK read null for each)
            "top_logprobs": req.top_logprobs or 0, "user": req.user,
            "safety_identifier": req.safety_identifier, "prompt_cache_key": req.prompt_cache_key,
            "prompt_cache_retention": req.prompt_cache_retention,
            "background": False,  # (background=true is refused)
            "reasoning": {"effort": None, "summary": None},  # no reasoning model: none was done
        }  # fmt: skip

    def _finish(self, response: dict, output: list[dict], finish: str | None, usage: dict | None) -> dict:
        response["output"] = output
        response["usage"] = _usage(usage)
        if finish == "length":
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            response["status"] = "completed"
            response["completed_at"] = int(time.time())  # OpenAI's, set only when completed
        return response

    async def count_input_tokens(self, req: ResponsesRequest) -> dict:
        """OpenAI's POST /v1/responses/input_tokens: the prompt `create` would run, counted (the
        previous response's conversation, instructions and tools in it) and run nowhere. Its
        path was GET /v1/responses/{id}'s, so the SDK's input_tokens.count got a 405."""
        refuse_unsupported(req)
        history = self._continued(req)
        chat = to_chat(req, history)
        self.serving.check_model(chat.model)
        try:
            ids = await self.serving.render_chat(chat)
        except ValueError as e:
            _name_responses_fields(e)
            raise
        return {"object": "response.input_tokens", "input_tokens": len(ids)}

    def _continued(self, req: ResponsesRequest) -> list[dict]:
        """The conversation previous_response_id continues ([] without one), its item_references
        replaced by the items; an item the chain already carries, sent again, is refused."""
        history: list[dict] = []
        carried: list[dict] = []  # the chain's items, which previous_response_id carries
        if req.previous_response_id == "":  # OpenAI's minimum length; it was looked up, "not found"
            raise EmptyStringError(
                "previous_response_id: empty string; give a stored response's id, or leave it out"
            )
        if req.previous_response_id in self.live:  # its conversation has no end yet
            raise ValueError(
                f"previous_response_id: response {req.previous_response_id!r} is still in progress; "
                "continue it once it has completed"
            )
        if req.previous_response_id is not None:
            try:
                _, history = self.store.get(req.previous_response_id)
            except ResponseNotFoundError:
                raise PreviousResponseNotFoundError(
                    f"previous_response_id: previous response with id {req.previous_response_id!r} not found "
                    "(never stored, or expired)"
                ) from None
            carried = chain_items(req.previous_response_id, self.store.held)
        refuse_duplicates(req.input, carried)
        req.input = resolved(req.input, self.store.item)  # (as if the items were sent)
        return history

    async def create(self, req: ResponsesRequest, raw: Request):
        refuse_unsupported(req)
        history = self._continued(req)
        try:
            try:
                run = await self._chat_run(req, history, raw)
                conversation = history + input_messages(req.input, history)
            except ContextLengthError as e:
                if req.truncation != "auto":
                    raise
                conversation = history + input_messages(req.input, history)
                run = await self._run_truncated(req, conversation, raw, e)
        except ValueError as e:
            _name_responses_fields(e)
            raise
        rid = _new_id("resp")
        response = self._skeleton(req, rid, req.model or self.serving.model_names[0])
        items = stored_input_items(req.input)
        if req.stream:
            out, given = _EventBuilder(), (conversation, items)
            if req.store:
                self.live.add(response, out.output, items)
            events = self._events(run.chunks, response, given, req.store, req.max_tool_calls, out)
            streamed = self.serving.sse_response(run.gen, events, run.streams, responses_api=True)
            # after the engine's streams are aborted: the response a client left is kept, cancelled
            left = BackgroundTask(self._keep_if_left, response, out, given, req.store)
            streamed.background = BackgroundTasks([streamed.background, left])
            return streamed
        choice = run.body["choices"][0]
        message = choice["message"]
        output = []
        if message.get("content") or not message.get("tool_calls"):
            logprobs = (choice.get("logprobs") or {}).get("content")
            output.append(_message_item(message.get("content") or "", logprobs=logprobs))
        calls = message.get("tool_calls") or []
        for tc in calls[: req.max_tool_calls]:  # the rest are ignored
            output.append(_call_item(tc["id"], tc["function"]["name"], tc["function"]["arguments"]))
        kept_last = req.max_tool_calls is None or len(calls) <= req.max_tool_calls  # the cut item is kept
        _close_items(output, choice["finish_reason"] == "length" and kept_last)
        self._finish(response, output, choice["finish_reason"], run.body["usage"])
        if req.store:
            self.store.put(response, conversation + _assistant_turn(output), items)
        return JSONResponse(response)

    async def _chat_run(self, req: ResponsesRequest, history: list[dict], raw: Request) -> Run:
        """The chat request behind the response, started; a batch line's (the runner marks its
        own requests: no HTTP client can) at background priority, as its chat lines are."""
        chat = to_chat(req, history)
        if getattr(raw.state, "batch_line", False):
            chat.priority = BACKGROUND_PRIORITY
        return await self.serving.chat_run(chat, raw)

    async def _run_truncated(
        self, req: ResponsesRequest, conversation: list[dict], raw: Request, error: ContextLengthError
    ) -> Run:
        """truncation "auto", as OpenAI's: the conversation's oldest items are dropped until the
        prompt and max_output_tokens fit the context. It is cut only where a user message
        starts a turn, so no tool output is left without its call; instructions are kept, and
        the stored conversation stays whole. Still too long from the last user message: the
        context-length error, as with "disabled"."""
        rest = req.model_copy(update={"input": []})  # (its input is in `conversation`)
        fits = len(conversation) - self.serving.engine.limits.max_model_len  # fewer turns from here on
        for start in (i for i, m in enumerate(conversation) if i >= max(1, fits) and m.get("role") == "user"):
            try:
                return await self._chat_run(rest, conversation[start:], raw)
            except ContextLengthError as e:
                error = e
        raise error

    async def _events(
        self, chunks: AsyncIterator[dict], response: dict, given: Given, store: bool,
        max_calls: int | None, out: _EventBuilder,
    ) -> AsyncIterator[dict]:  # fmt: skip
        """Chat chunks -> Responses stream events (calls past max_calls are left out); `given`:
        the conversation so far and the input items, stored with the response. An engine
        failure ends it with an error event and response.failed (responses_ending.py)."""
        yield out.event("response.created", response=response)
        yield out.event("response.in_progress", response=response)
        finish, usage, dropped = None, None, False
        try:
            async for chunk in chunks:
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    delta, logprobs = choice["delta"], (choice.get("logprobs") or {}).get("content")
                    for e in out.text(delta.get("content") or "", logprobs):
                        yield e
                    for tc in delta.get("tool_calls") or []:
                        if max_calls is not None and tc["index"] >= max_calls:
                            dropped = True
                            continue
                        for e in out.call(tc):
                            yield e
                    finish = choice.get("finish_reason") or finish
        except STREAM_FAILURES as e:
            param = param_of(str(e)) if isinstance(e, RequestRefusedError) else None
            yield out.event("error", code=failure_code(e), message=str(e), param=param)
            end_early(response, out.output, "failed", str(e), response_error_code(e))
            self._keep(response, out.output, given, store)
            yield out.event("response.failed", response=response)
            return
        closing = out.close(cut=finish == "length" and not dropped)
        # stored whole before the last events go: a client may leave once it has the items it needs
        self._finish(response, out.output, finish, usage)
        self._keep(response, out.output, given, store)
        for e in closing:
            yield e
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield out.event(kind, response=response)

    def _keep(self, response: dict, output: list[dict], given: Given, store: bool) -> None:
        """Stored as it ended, unless it was deleted while it streamed."""
        if store and self.live.end(response["id"]):
            conversation, items = given
            self.store.put(response, conversation + _assistant_turn(output), items)

    async def _keep_if_left(self, response: dict, out: _EventBuilder, given: Given, store: bool) -> None:
        """Run when the stream's response has ended: one still in progress lost its client.
        (async: on the event loop, as every other use of the store, not in Starlette's threads)"""
        if response["status"] == "in_progress":
            self._keep(end_early(response, out.output, "cancelled"), out.output, given, store)


class _EventBuilder:
    """The output items of one streamed response, and the events that build them (numbered),
    in OpenAI's order: an item is added empty, then its part, deltas, dones. Each event holds
    a copy of the item as it stood then: clients add the deltas to what `added` carried."""

    def __init__(self) -> None:
        self.seq = 0
        self.output: list[dict] = []
        self.message: dict | None = None
        self.calls: dict[int, dict] = {}  # chat tool-call index -> its output item
        self.done: set[str] = set()  # ids of the items whose done events went out

    def event(self, kind: str, **fields: Any) -> dict:
        self.seq += 1
        return copy.deepcopy({"type": kind, "sequence_number": self.seq - 1, **fields})

    def _at(self, item: dict) -> dict:
        return {"output_index": self.output.index(item), "item_id": item["id"], "content_index": 0}

    def _add(self, item: dict) -> dict:
        self.output.append(item)
        return self.event("response.output_item.added", output_index=len(self.output) - 1, item=item)

    def text(self, delta: str, logprobs: list[dict] | None = None) -> list[dict]:
        if not delta:
            return []
        events = []
        if self.message is None:
            self.message = _message_item(None, "in_progress")
            events.append(self._add(self.message))
            self.message["content"].append(_text_part(""))
            part = self.message["content"][0]
            events.append(self.event("response.content_part.added", **self._at(self.message), part=part))
        logprobs = logprobs or []
        events.append(
            self.event("response.output_text.delta", **self._at(self.message), delta=delta, logprobs=logprobs)
        )
        self.message["content"][0]["text"] += delta
        self.message["content"][0]["logprobs"] += logprobs
        return events

    def call(self, tc: dict) -> list[dict]:
        events = []
        item = self.calls.get(tc["index"])
        if item is None:
            # calls are written one after another: the one before is whole, and done now, as
            # OpenAI's stream has it (a client may run a call before the next is written)
            for earlier in self.calls.values():
                if earlier["id"] not in self.done:
                    earlier["status"] = "completed"
                    events += self._done(earlier)
            item = self.calls[tc["index"]] = _call_item(tc["id"], tc["function"]["name"], "", "in_progress")
            events.append(self._add(item))
        args = tc["function"].get("arguments") or ""
        if args:
            at = {"item_id": item["id"], "output_index": self.output.index(item)}
            events.append(self.event("response.function_call_arguments.delta", **at, delta=args))
            item["arguments"] += args
        return events

    def _done(self, item: dict) -> list[dict]:
        """The events that end one item, as it stands."""
        self.done.add(item["id"])
        index = self.output.index(item)
        if item["type"] == "message":
            part = item["content"][0]
            text_done = self.event(
                "response.output_text.done", **self._at(item), text=part["text"], logprobs=part["logprobs"]
            )
            events = [text_done, self.event("response.content_part.done", **self._at(item), part=part)]
        else:
            at = {"item_id": item["id"], "output_index": index}
            done = {"name": item["name"], "arguments": item["arguments"]}  # name: OpenAI's event has it
            events = [self.event("response.function_call_arguments.done", **at, **done)]
        return [*events, self.event("response.output_item.done", output_index=index, item=item)]

    def close(self, cut: bool) -> list[dict]:
        """The done events of the items still open; `cut`: max_output_tokens ended the last item."""
        _close_items(self.output, cut)
        return [e for item in self.output if item["id"] not in self.done for e in self._done(item)]
