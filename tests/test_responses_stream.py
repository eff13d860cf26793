"""A streamed response's stored ending (responses.py), driven with chat chunks in-process: what a
client that leaves before the last event finds stored."""

from __future__ import annotations

import asyncio

from kvserve.engine.async_llm import RequestRefusedError
from kvserve.entrypoints.openai.response_store import MemoryResponseStore
from kvserve.entrypoints.openai.responses import ResponsesServing, _EventBuilder

USAGE = {
    "prompt_tokens": 5,
    "prompt_tokens_details": {"cached_tokens": 0},
    "completion_tokens": 3,
    "total_tokens": 8,
}
CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


async def _call_chunks():
    """A chat stream that writes one whole function call and ends."""
    yield {"choices": [{"index": 0, "delta": {"tool_calls": [CALL]}, "finish_reason": None}]}
    yield {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}
    yield {"choices": [], "usage": USAGE}


def _left_after(event_type: str) -> tuple[dict, list[dict]]:
    """The stored response and conversation, when the client leaves after the first `event_type`
    (the stream stops being read, as Starlette leaves it, then the response's background runs)."""
    store = MemoryResponseStore()
    serving = ResponsesServing(None, store)  # (the chat path is not used: the chunks are given)
    response = {"id": "resp_1", "status": "in_progress", "output": [], "error": None, "usage": None,
                "incomplete_details": None, "completed_at": None}  # fmt: skip
    given, out = ([{"role": "user", "content": "weather?"}], []), _EventBuilder()

    async def scenario() -> None:
        async for event in serving._events(_call_chunks(), response, given, True, None, out):
            if event["type"] == event_type:
                break
        await serving._keep_if_left(response, out, given, True)

    asyncio.run(scenario())
    return store.get("resp_1")


def test_a_client_leaving_once_it_has_the_whole_call_finds_the_response_completed():
    """A client may stop reading at the call's output_item.done (all it needs to run the call):
    the response was then stored "cancelled", though every token had been written."""
    stored, conversation = _left_after("response.output_item.done")
    assert stored["status"] == "completed" and stored["usage"]["output_tokens"] == 3
    assert [(o["type"], o["status"]) for o in stored["output"]] == [("function_call", "completed")]
    assert conversation[-1]["tool_calls"][0]["id"] == "call_1"


def test_a_client_leaving_mid_call_finds_it_cancelled_and_the_call_not_carried():
    stored, conversation = _left_after("response.function_call_arguments.delta")
    assert stored["status"] == "cancelled" and stored["usage"] is None
    assert [(o["type"], o["status"]) for o in stored["output"]] == [("function_call", "incomplete")]
    assert "tool_calls" not in conversation[-1]  # a call cut short is no call to answer


async def _refused_chunks():
    """A chat stream that writes a word, then the engine refuses the request for its own field."""
    yield {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]}
    raise RequestRefusedError("allowed_token_ids: none of them is a token the constraint allows")


def test_a_request_refused_mid_stream_fails_as_the_clients_error():
    """A refusal of the request's own parameters (RequestRefusedError, a 400 unstreamed) ended a
    streamed response as the server's fault: error code engine_error, response.failed's error
    server_error. Now the error event names the field with a 400's code and the failed
    response's error is OpenAI's invalid_prompt; it is stored so, with the text written."""
    store = MemoryResponseStore()
    serving = ResponsesServing(None, store)
    response = {"id": "resp_2", "status": "in_progress", "output": [], "error": None, "usage": None,
                "incomplete_details": None, "completed_at": None}  # fmt: skip
    given, out = ([{"role": "user", "content": "hi"}], []), _EventBuilder()

    async def events() -> list[dict]:
        return [e async for e in serving._events(_refused_chunks(), response, given, True, None, out)]

    got = asyncio.run(events())
    error, failed = got[-2], got[-1]
    assert error["type"] == "error" and error["code"] == "invalid_value", error
    assert error["param"] == "allowed_token_ids"
    assert failed["type"] == "response.failed" and failed["response"]["error"]["code"] == "invalid_prompt"
    stored, _ = store.get("resp_2")
    assert stored["status"] == "failed" and stored["error"]["code"] == "invalid_prompt"
    assert stored["output"][0]["content"][0]["text"] == "Hi" and stored["output"][0]["status"] == "incomplete"
