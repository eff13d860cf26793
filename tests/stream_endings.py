"""How a failed stream must end, checked alike at every front (the gateway, the pd-proxy, the Ray
Serve front): as `kvserve serve` ends one (routing/stream_failure.py)."""

from __future__ import annotations

import json


def sse_events(raw: bytes | str) -> list[str]:
    """The events of a streamed answer, each its lines joined by a newline."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    return [e.strip() for e in text.replace("\r\n", "\n").split("\n\n") if e.strip()]


def assert_chat_stream_failed(events: list[str], says: str) -> dict:
    """A chat or completions stream: an error event in OpenAI's shape, then `data: [DONE]`."""
    assert events[-1] == "data: [DONE]", events[-2:]
    err = json.loads(events[-2].removeprefix("data: "))["error"]
    assert err["code"] == "upstream_error" and says in err["message"], err
    return err


def assert_responses_stream_failed(events: list[str], sequence_number: int, says: str) -> dict:
    """A Responses stream: the API's own error event, numbered after the events sent, no [DONE]."""
    assert "[DONE]" not in "".join(events), events
    head, data = events[-1].split("\n")
    err = json.loads(data.removeprefix("data: "))
    assert head == "event: error" and err["type"] == "error", err
    assert err["sequence_number"] == sequence_number, err
    assert err["code"] == "upstream_error" and says in err["message"], err
    return err


def assert_drained_at_deadline(events: list[str], answer, says: str) -> dict:
    """A front's drain deadline (--shutdown-timeout): the stream still running ends with a
    `shutting_down` error event and `data: [DONE]`; the request still waiting gets a 503 with
    Retry-After, in OpenAI's shape."""
    assert events[-1] == "data: [DONE]" and len(events) < 600, events[-3:]
    err = json.loads(events[-2].removeprefix("data: "))["error"]
    assert err["code"] == "shutting_down" and says in err["message"], err
    assert answer.status_code == 503 and answer.headers["retry-after"] == "5", answer.text
    assert answer.json()["error"]["code"] == "shutting_down", answer.text
    return err
