"""Reading what the gateway itself needs from a client's body (text to count, route and cache
by) without trusting its shape: the backend validates the request and answers a malformed one
with its own 400, so nothing here may raise on a wrong type."""

from __future__ import annotations

from kvserve.routing.request_text import content_text

__all__ = ["content_text", "messages_of"]


def messages_of(body: dict) -> list:
    """The body's messages when they are a list, else [] (the backend will refuse them)."""
    msgs = body.get("messages")
    return msgs if isinstance(msgs, list) else []
