"""The server's SSE JSON: the characters JSON allows raw but line splitters break at are escaped."""

from __future__ import annotations

import json

from kvserve.entrypoints.sse_json import sse_json


def test_line_breakers_escaped_and_the_object_kept():
    obj = {"text": "a\u2028b\x85c\u2029d\u00e9\u4e2d", "n": [1, 2.5, None]}
    data = sse_json(obj)
    assert len(data.decode().splitlines()) == 1
    assert b"\\u2028" in data and b"\\u0085" in data and b"\\u2029" in data
    assert json.loads(data) == obj
    assert "\u00e9\u4e2d".encode() in data  # other non-ASCII text stays raw UTF-8
