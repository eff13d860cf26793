"""What makes two requests "the same" for the response cache.

Exact mode: the alias, the path and every field of the body that can change the answer
(messages or prompt, tools, tool_choice, response_format, sampling parameters, seed, ...)
hashed as canonical JSON. Only fields that cannot change the answer are dropped.

Semantic mode compares the *whole conversation's* text by embedding, inside a bucket of
requests whose other fields (and message roles) are exactly equal. Embeddings place "is it
safe to X" and "is it not safe to X" close together (one token apart, the same topic): the
failure users report from LiteLLM's and GPTCache's semantic caches. So a semantic hit also
needs the same *guard*: the negations (not, no, never, n't, ...) and the numbers of the
conversation, which are exactly the small edits that flip or change an answer.
"""

from __future__ import annotations

import hashlib
import json
import re

from kvserve.gateway.body import content_text

# fields that never change the answer (transport, bookkeeping)
_TRANSPORT = ("model", "stream", "stream_options", "user", "metadata", "store", "priority")
_TEXT = ("messages", "prompt")
_NEGATION = re.compile(
    r"\b(?:not|no|never|none|nothing|nobody|nowhere|neither|nor|without|cannot)\b|n't\b", re.IGNORECASE
)
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def _digest(obj: object) -> str:
    raw = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()  # a lone surrogate is valid JSON


def exact_key(alias: str, path: str, body: dict) -> str:
    kept = {k: v for k, v in body.items() if k not in _TRANSPORT}
    return _digest({"alias": alias, "path": path, "body": kept})


def _content(c: object) -> str:
    if isinstance(c, list):  # content parts: their text
        return content_text(c)
    return c if isinstance(c, str) else json.dumps(c, sort_keys=True) if c is not None else ""


def conversation_text(body: dict) -> str:
    """The text the semantic mode embeds: every message, role by role (not the last only:
    the same question after a different exchange is a different question)."""
    if isinstance(body.get("messages"), list):
        return "\n".join(
            f"{m.get('role', '')}: {_content(m.get('content'))}"
            for m in body["messages"]
            if isinstance(m, dict)
        )
    return _content(body.get("prompt"))


def bucket_key(alias: str, path: str, body: dict) -> str:
    """Everything but the text, exactly; the roles in order (tool results, system prompts)."""
    kept = {k: v for k, v in body.items() if k not in _TRANSPORT and k not in _TEXT}
    msgs = body.get("messages")
    roles = [m.get("role") for m in msgs if isinstance(m, dict)] if isinstance(msgs, list) else None
    return _digest({"alias": alias, "path": path, "body": kept, "roles": roles})


def guard(text: str) -> str:
    """The negations (each one counted, contractions as 'not') and the numbers, in order."""
    negations = len(_NEGATION.findall(text))
    return json.dumps([negations, _NUMBER.findall(text)])
