"""Pass an upstream SSE stream through event for event while watching for the usage chunk the
gateway asked for (include_usage), and hide it again when the client did not ask."""

from __future__ import annotations

import json

_NULL_USAGE = (b',"usage":null', b', "usage": null')


class SSERelay:
    def __init__(self, client_wants_usage: bool) -> None:
        self.strip = not client_wants_usage
        self.usage: dict | None = None
        self.events = 0
        self.data_events = 0  # events with data: comments (": ping") and bare fields are not an answer
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
            self.data_events += _has_data(ev)
            out.append(ev + b"\n\n")
        return b"".join(out)

    def tail(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest

    def _usage(self, ev: bytes) -> bytes | None:
        for null in _NULL_USAGE:
            if null in ev:
                return ev.replace(null, b"") if self.strip else ev
        if not ev.startswith(b"data:"):
            return ev
        try:
            obj = json.loads(ev[5:])
        except ValueError:
            return ev
        if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
            if self.strip:
                if not obj.get("choices"):
                    return None
                obj.pop("usage")
                return b"data: " + json.dumps(obj, separators=(",", ":")).encode()
        return ev


def _has_data(ev: bytes) -> bool:
    return any(line == b"data" or line.startswith(b"data:") for line in ev.split(b"\n"))


def error_event(message: str, code: str = "upstream_error") -> bytes:
    """The final event of a stream whose deployment failed after its first byte (a string
    code, as the error would carry outside a stream)."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"
