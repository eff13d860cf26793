"""A streamed response's stored ending (responses.py), driven with chat chunks in-process: what a
client that leaves before the last event finds stored."""

from __future__ import annotations

import asyncio

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
