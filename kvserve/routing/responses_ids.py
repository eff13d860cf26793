"""Responses API ids as a front hands them out (the gateway, the pd-proxy, the Ray Serve front):
the backend's own id with the server that stored it (a gateway deployment, a decode engine, a
replica), so a follow-up (previous_response_id, GET, DELETE) reaches that server.

A stored response (and the conversation previous_response_id continues) lives only on the
server that answered; the id is the only thing every front instance sees again, with no
shared table to lose or expire, so the server rides in it: `resp_` + base64url of
`kvgw1:<length of the server id>:<server id><backend id>`. Ids no front made do not decode."""

from __future__ import annotations

import base64
import binascii
import json

RESPONSES = "/responses"
_TAG = "kvgw1"


def wrap_id(prefix: str, server_id: str, rest: str) -> str:
    """`prefix` + base64url of `kvgw1:<length of server_id>:<server_id><rest>`: the form every
    front's ids take (the gateway's file and batch ids too: gateway/batch_ids.py)."""
    raw = f"{_TAG}:{len(server_id)}:{server_id}{rest}".encode()
    return prefix + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def unwrap_id(prefix: str, public_id: object) -> tuple[str, str] | None:
    """(server id, the rest) of an id `wrap_id` made with `prefix`, or None for any other."""
    if not isinstance(public_id, str) or not public_id.startswith(prefix):
        return None
    b64 = public_id[len(prefix) :]
    try:
        raw = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).decode()
    except (binascii.Error, ValueError):
        return None
    tag, _, rest = raw.partition(":")
    size, _, ids = rest.partition(":")
    if tag != _TAG or not size.isdigit() or int(size) > len(ids):
        return None
    return ids[: int(size)], ids[int(size) :]


def encode_id(dep_id: str, backend_id: str) -> str:
    return wrap_id("resp_", dep_id, backend_id)


def decode_id(public_id: object) -> tuple[str, str] | None:
    """(deployment id, backend id), or None for an id this gateway did not hand out."""
    held = unwrap_id("resp_", public_id)
    return held if held is not None and held[0] and held[1] else None


def previous_id_problem(value: object) -> str | None:
    """Why a request's previous_response_id cannot be an id (a number, a list, an object), or
    None (absent, null or a string). Looked up as an id it was answered "not found", which sent
    the client looking for a response instead of at its own field; `kvserve serve` answers a 400
    naming the field's type, so every front says the same."""
    if value is None or isinstance(value, str):
        return None
    kinds = {bool: "a boolean", int: "a number", float: "a number", list: "an array", dict: "an object"}
    kind = kinds.get(type(value), "another type")
    return f"previous_response_id: must be a string (a response id), got {kind}"


def public_response(obj: dict, dep_id: str) -> dict:
    """A Response object with its ids (its own and previous_response_id) as the gateway's."""
    for field in ("id", "previous_response_id"):
        if isinstance(obj.get(field), str) and obj[field]:
            obj[field] = encode_id(dep_id, obj[field])
    return obj


def public_body(content: bytes, dep_id: str, body: dict | None = None) -> bytes:
    """A backend's JSON answer (a Response, or DELETE's {"id", "deleted"}) with public ids;
    anything that is no JSON object goes on as it came. (`body`, unused, gives it
    public_error's signature: the proxy calls one or the other.)"""
    try:
        obj = json.loads(content)
    except (ValueError, RecursionError):
        return content
    if not isinstance(obj, dict):
        return content
    return json.dumps(public_response(obj, dep_id)).encode()


def public_error(content: bytes, dep_id: str, body: dict | None) -> bytes:
    """A backend's error about the request's previous_response_id names the id the client sent
    (the backend knows only its own)."""
    prev = (body or {}).get("previous_response_id")
    if not isinstance(prev, str) or not prev or prev.encode() not in content:
        return content
    return content.replace(prev.encode(), encode_id(dep_id, prev).encode())


def public_event(ev: bytes, dep_id: str) -> bytes:
    """One SSE event of a Responses stream: the Response it carries (response.created,
    .in_progress, .completed, ...) with public ids; other events as they came (an `event:`
    line, which OpenAI's and vLLM's streams have, stays)."""
    if b'"response"' not in ev:
        return ev
    lines = ev.split(b"\n")
    for i, line in enumerate(lines):
        if not line.startswith(b"data:"):
            continue
        try:
            obj = json.loads(line[5:])
        except (ValueError, RecursionError):
            continue
        if isinstance(obj, dict) and isinstance(obj.get("response"), dict):
            public_response(obj["response"], dep_id)
            lines[i] = b"data: " + json.dumps(obj).encode()
    return b"\n".join(lines)


class EventRewriter:
    """A Responses stream's bytes, as they come, cut into whole SSE events each passed through
    public_event (an id split across two chunks is still rewritten)."""

    def __init__(self, dep_id: str) -> None:
        self.dep_id = dep_id
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        self._buf += chunk
        if b"\r\n" in self._buf:  # CRLF line ends are valid SSE too (a trailing CR waits for its LF)
            self._buf = self._buf.replace(b"\r\n", b"\n")
        if b"\n\n" not in self._buf:
            return b""
        *events, self._buf = self._buf.split(b"\n\n")
        return b"".join(public_event(ev, self.dep_id) + b"\n\n" for ev in events)

    def flush(self) -> bytes:
        """What is left when the stream ends (an event without its blank line) as it came."""
        rest, self._buf = self._buf, b""
        return public_event(rest, self.dep_id) if rest else b""
