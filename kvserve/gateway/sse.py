"""Pass an upstream SSE stream through event for event while watching for the usage chunk the
gateway asked for (include_usage), and hide it again when the client did not ask. A Responses
API stream carries its usage in the response.completed event, and its ids are rewritten as
they pass (`rewrite`)."""

from __future__ import annotations

import json
from collections.abc import Callable

from kvserve.disagg.stream_start import event_code, event_error, has_data, is_opening
from kvserve.gateway.usage import normalized

_NULL_USAGE = (b',"usage":null', b', "usage": null')
# a Responses stream's events that carry output (counted for a stream that ends without usage)
_DELTA_TYPES = frozenset({"response.output_text.delta", "response.function_call_arguments.delta"})


class SSERelay:
    def __init__(self, client_wants_usage: bool, rewrite: Callable[[bytes], bytes] | None = None) -> None:
        self.strip = not client_wants_usage
        self.rewrite = rewrite  # applied to each whole event passed on
        self.usage: dict | None = None
        self.events = 0
        self.data_events = 0  # events with data: comments (": ping") and bare fields are not an answer
        # the first event that is the answer's: not a comment, nor chat's opening chunk (the role,
        # no content), which kvserve and vLLM send before the model has produced anything
        self.answered = False
        self.error_first: str | None = None  # that event's message when it was an error
        self.error_code: str | None = None  # and its code
        # an error event after the answer began (kvserve's engine died mid-answer): its message
        # and code; the stream goes on to the client as it came, but did not succeed
        self.error_later: tuple[str, str | None] | None = None
        self._chunks = self._chars = 0  # of the completion text passed on (usage when none came)
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to send on for this upstream chunk (whole events only)."""
        self._buf += chunk
        if b"\r\n" in self._buf:  # CRLF line ends (sse-starlette's default) are valid SSE too
            self._buf = self._buf.replace(b"\r\n", b"\n")  # (a trailing CR waits for its LF)
        if b"\n\n" not in self._buf:
            return b""
        *events, self._buf = self._buf.split(b"\n\n")
        out = []
        for ev in events:
            if b'"usage"' in ev:
                ev = self._usage(ev)
                if ev is None:
                    continue
            self.events += 1
            self.data_events += has_data(ev)
            if not self.answered and has_data(ev):
                self._first_answer(ev)
            elif b'"error"' in ev and self.error_later is None:
                self._later_error(ev)
            if b'"choices"' in ev:
                self._count(ev)
            elif b'.delta"' in ev:
                self._count_delta(ev)
            if self.rewrite is not None:
                ev = self.rewrite(ev)
            out.append(ev + b"\n\n")
        return b"".join(out)

    def _first_answer(self, ev: bytes) -> None:
        try:
            obj = json.loads(ev[ev.index(b"{") :])
        except (ValueError, RecursionError):
            obj = None  # ([DONE], or anything else: an answer)
        if is_opening(obj):
            return
        self.answered = True
        self.error_first, self.error_code = event_error(obj), event_code(obj)

    def _later_error(self, ev: bytes) -> None:
        obj = _data_json(ev)
        message = event_error(obj)
        if message is not None:
            self.error_later = (message, event_code(obj))

    def _count(self, ev: bytes) -> None:
        try:
            obj = json.loads(ev[ev.index(b"{") :])
            choices = obj["choices"]
        except (ValueError, KeyError, TypeError, RecursionError):
            return
        for c in choices if isinstance(choices, list) else []:
            text = _text(c) if isinstance(c, dict) else ""
            self._chunks += bool(text)
            self._chars += len(text)

    def _count_delta(self, ev: bytes) -> None:
        """A Responses stream's text or arguments delta."""
        obj = _data_json(ev)
        if isinstance(obj, dict) and obj.get("type") in _DELTA_TYPES and isinstance(obj.get("delta"), str):
            self._chunks += bool(obj["delta"])
            self._chars += len(obj["delta"])

    def delivered_usage(self, prompt_tokens: int) -> dict:
        """Usage for a stream that ended without the backend's (cut short, or a backend that
        does not report it): the completion tokens that reached the client, counted as one a
        chunk or ~4 characters a token, whichever is more."""
        completion = max(self._chunks, -(-self._chars // 4))
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}  # fmt: skip

    def finish(self) -> bytes:
        """At the end of the upstream body: its last event when that ended without the blank
        line (held back as incomplete, it was never sent: the client missed its [DONE])."""
        return self.feed(b"\n\n") if self._buf.strip() else b""

    def _usage(self, ev: bytes) -> bytes | None:
        for null in _NULL_USAGE:
            if null in ev:
                return ev.replace(null, b"") if self.strip else ev
        obj = _data_json(ev) if b'"response"' in ev else None  # (a Responses stream's final event)
        response = obj.get("response") if isinstance(obj, dict) else None
        if isinstance(response, dict) and isinstance(response.get("usage"), dict):
            self.usage = normalized(response["usage"])
            return ev
        if not ev.startswith(b"data:"):
            return ev
        try:
            obj = json.loads(ev[5:])
        except (ValueError, RecursionError):
            return ev
        if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
            self.usage = normalized(obj["usage"])  # (the client gets the backend's own, as it came)
            if self.strip:
                if not obj.get("choices"):
                    return None
                obj.pop("usage")
                return b"data: " + json.dumps(obj, separators=(",", ":")).encode()
        return ev


def _text(choice: dict) -> str:
    """A chunk's completion text: completions' text, chat's content / reasoning / tool-call
    arguments."""
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return choice.get("text") if isinstance(choice.get("text"), str) else ""
    parts = [delta.get("content"), delta.get("reasoning_content")]
    calls = delta.get("tool_calls")
    for call in calls if isinstance(calls, list) else []:
        fn = call.get("function") if isinstance(call, dict) else None
        parts.append(fn.get("arguments") if isinstance(fn, dict) else None)
    return "".join(p for p in parts if isinstance(p, str))


def _data_json(ev: bytes) -> object:
    """The JSON of an event's data line (after an `event:` line, if any); None if none parses."""
    for line in ev.split(b"\n"):
        if line.startswith(b"data:"):
            try:
                return json.loads(line[5:])
            except (ValueError, RecursionError):
                return None
    return None
