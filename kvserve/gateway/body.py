"""Reading what the gateway itself needs from a client's body (text to count, route and cache
by) without trusting its shape: the backend validates the request and answers a malformed one
with its own 400, so nothing here may raise on a wrong type."""

from __future__ import annotations


def content_text(content: object) -> str:
    """A message's text: a string as is, content parts' string `text`s joined, else ''."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def messages_of(body: dict) -> list:
    """The body's messages when they are a list, else [] (the backend will refuse them)."""
    msgs = body.get("messages")
    return msgs if isinstance(msgs, list) else []
