"""JSON for server-sent events that every client splits into the same lines.

JSON may carry U+0085, U+2028 and U+2029 unescaped, and msgspec writes them raw. SSE ends a
line only at CR or LF, but many clients split a stream with Python's `str.splitlines`, which also
breaks at those three (httpx's `aiter_lines`, so the Ray Serve test's client saw half an event
when the tiny model generated one). Escaping them keeps each event on one line for any client.
"""

from __future__ import annotations

import msgspec

_encoder = msgspec.json.Encoder()
# Their UTF-8 bytes, which occur in valid UTF-8 only as these characters.
_LINE_BREAKERS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def sse_json(obj: object) -> bytes:
    """`obj` as JSON with no character any line splitter breaks a line at."""
    data = _encoder.encode(obj)
    for raw, escaped in _LINE_BREAKERS:
        if raw in data:
            data = data.replace(raw, escaped)
    return data
