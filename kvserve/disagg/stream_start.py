"""When a stream has started: its first event that is the answer's. Comments (`: ping`) and the
events a server sends before the model has produced anything (chat's opening chunk with only
the role, a Responses stream's response.created / .in_progress) are not; until that event
arrives a proxy can still give the request to another engine, and its first-byte timeout
runs. Shared by `kvserve pd-proxy` (decode.py) and the gateway (gateway/sse.py)."""

from __future__ import annotations

import json

_OPENING_TYPES = frozenset({"response.created", "response.in_progress", "response.queued"})


def is_opening(obj: object) -> bool:
    """Chat's opening chunk: every choice only a role (other fields empty), nothing finished; a
    Responses stream's response.created / .in_progress."""
    if isinstance(obj, dict) and obj.get("type") in _OPENING_TYPES and obj.get("error") is None:
        return True
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or not choices or obj.get("error") is not None:
        return False
    usage = obj.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens"):  # (continuous usage: 0 so far)
        return False
    for c in choices:
        delta = c.get("delta") if isinstance(c, dict) else None
        if not isinstance(delta, dict) or c.get("finish_reason") is not None or c.get("logprobs"):
            return False
        if any(k != "role" and v for k, v in delta.items()):  # (OpenAI's also has "refusal": null)
            return False
    return True


def has_data(ev: bytes) -> bool:
    return any(line == b"data" or line.startswith(b"data:") for line in ev.split(b"\n"))


# error codes of a stream's error event that say the engine itself is gone or going (kvserve's,
# as its non-streamed 503s / 504 say it), not that this request failed
ENGINE_GONE_CODES = frozenset({"engine_dead", "shutting_down", "timeout"})
# the code of an error event that says the request itself is wrong (kvserve's streamed 400, e.g.
# allowed_token_ids its grammar refuses at the first token): every engine would refuse it, so a
# stream beginning with it is the answer, passed on, not a failure to try elsewhere (a 502)
REQUEST_ERROR_CODES = frozenset({"invalid_value"})


def event_code(obj: object) -> str | None:
    """An error event's code (OpenAI's {"error": {"code"}} or the Responses API's `code`)."""
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    code = err.get("code") if isinstance(err, dict) else None
    if code is None and obj.get("type") == "error":
        code = obj.get("code")
    return code if isinstance(code, str) else None


def event_error(obj: object) -> str | None:
    """The message of an event that is an error (OpenAI's {"error": ...}, or the Responses
    API's `error` / `response.failed` events), short; None for any other event."""
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if err is None and obj.get("type") in ("error", "response.failed"):
        response = obj.get("response") if isinstance(obj.get("response"), dict) else {}
        err = obj.get("message") or response.get("error") or obj["type"]
    if err is None:
        return None
    msg = err.get("message") if isinstance(err, dict) else err
    return str(msg)[:200]


class StreamStart:
    """Fed a stream's first chunks: `answered` once a whole event is the answer's (`error`: its
    message when that event is an error, `code` its code)."""

    def __init__(self) -> None:
        self.answered = False
        self.error: str | None = None
        self.code: str | None = None
        self._buf = b""

    def feed(self, chunk: bytes) -> None:
        self._buf = (self._buf + chunk).replace(b"\r\n", b"\n")
        *events, self._buf = self._buf.split(b"\n\n")
        for ev in events:
            if self.answered or not has_data(ev):
                continue
            try:
                obj = json.loads(ev[ev.index(b"{") :])
            except (ValueError, RecursionError):
                obj = None  # ([DONE], or anything else: an answer)
            if not is_opening(obj):
                self.answered, self.error, self.code = True, event_error(obj), event_code(obj)
