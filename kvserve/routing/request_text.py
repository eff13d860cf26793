"""The prompt text a request-aware router matches (cache-aware's prefix index, over text): the
text the engine reads, so one conversation routes the same whether its messages' content is
a string or a list of parts (the engine joins text and refusal parts: protocol.ChatMessage).
Read without trusting the body's shape: the backend answers a malformed one."""

from __future__ import annotations

READABLE = {"text": "text", "refusal": "refusal", "input_text": "text", "output_text": "text"}


def content_text(content: object) -> str:
    """A message's text: a string as is, its readable parts' strings joined, else ''."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    out = []
    for p in content:
        key = READABLE.get(p.get("type", "text")) if isinstance(p, dict) else None
        if key is not None and isinstance(p.get(key), str):
            out.append(p[key])
    return "".join(out)


def prompt_text(body: dict) -> str:
    """The messages with their roles (earlier turns are a conversation's prefix), a string
    prompt, or the Responses API's input (a string or message items)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        messages = body.get("input")
        if isinstance(messages, str):
            return messages
    if isinstance(messages, list):
        return "".join(
            f"{m.get('role', '')}:{content_text(m.get('content'))}\n" for m in messages if isinstance(m, dict)
        )
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else str(prompt) if isinstance(prompt, list) else ""
