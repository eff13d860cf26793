"""Tool calling, response side: finding calls in the generated text, whole or streamed.

`parse_calls` reads the text as it stands (possibly cut short): forced modes produce JSON
we constrained, "auto" looks for the chat template's formats — `<tool_call>{...}</tool_call>`
blocks (Hermes / Qwen2 / SmolLM2, a list inside one block is accepted too) or a bare JSON
call as Llama 3 writes it ({"name", "parameters"}). `ToolCallStream` turns the growing text
into OpenAI's streamed tool-call deltas; concatenated, they equal the non-streamed calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_TAG_OPEN, _TAG_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text (a prefix of it while the call is still being generated)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_calls(text: str, mode: str, named: str | None = None) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) for this mode's output so far."""
    if mode == "named":
        return None, [ParsedCall(named or "", text)]
    if mode == "required":
        return None, _parse_array(text)
    return _parse_auto(text)


def _parse_array(text: str) -> list[ParsedCall]:
    """Calls of `[{"name": ..., "arguments": {...}}, ...]`, the last one possibly incomplete."""
    i = len(text) - len(text.lstrip())
    if not text.startswith("[", i):
        return []
    i += 1
    calls = []
    while m := _HEAD.match(text, i):
        start = m.end()
        end = json_value_end(text, start)
        calls.append(ParsedCall(json.loads(f'"{m.group(1)}"'), text[start : end or len(text)]))
        if end is None:
            break
        rest = re.match(r"\s*\}\s*,", text[end:])
        if not rest:
            break
        i = end + rest.end()
    return calls


def json_value_end(text: str, start: int) -> int | None:
    """Index just past the JSON object/array/string starting at text[start], or None if cut."""
    depth, in_str, esc = 0, False, False
    for j in range(start, len(text)):
        ch = text[j]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if depth == 0:
                    return j + 1
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def _calls_from_json(obj) -> list[ParsedCall]:
    items = obj if isinstance(obj, list) else [obj]
    calls = []
    for it in items:
        if not isinstance(it, dict) or not isinstance(it.get("name"), str):
            return []
        args = it.get("arguments", it.get("parameters", {}))
        calls.append(
            ParsedCall(it["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
        )
    return calls


def _parse_auto(text: str) -> tuple[str | None, list[ParsedCall]]:
    if _TAG_OPEN in text:
        calls = []
        for m in _BLOCK.finditer(text):
            try:
                calls += _calls_from_json(json.loads(m.group(1)))
            except ValueError:
                return text, []
        content = _BLOCK.sub("", text).strip()
        return (content or None), calls
    body = text.strip()
    if body.startswith(("{", "[")):
        try:
            calls = _calls_from_json(json.loads(body))
        except ValueError:
            calls = []
        if calls:
            return None, calls
    return text, []


def auto_hold_from(text: str) -> int:
    """In "auto" mode, where text that may still become a tool call begins (len(text): none)."""
    if _TAG_OPEN in text:
        return text.index(_TAG_OPEN)
    stripped = text.lstrip()
    if stripped.startswith(("{", "[")) or (stripped and _TAG_OPEN.startswith(stripped)):
        return 0
    for k in range(min(len(_TAG_OPEN) - 1, len(text)), 0, -1):  # a tag cut at the end
        if text.endswith(_TAG_OPEN[:k]):
            return len(text) - k
    return len(text)


class ToolCallStream:
    """Feeds on a choice's growing text; yields content and tool-call deltas in OpenAI's shape."""

    def __init__(self, mode: str, named: str | None = None, parallel: bool = True) -> None:
        self.mode, self.named, self.parallel = mode, named, parallel
        self.text = ""
        self.content_sent = 0
        self.ids: list[str] = []
        self.args_sent: list[int] = []

    def feed(self, delta_text: str, finished: bool) -> tuple[str, list[dict]]:
        """(content delta, tool-call deltas) after this piece of text."""
        self.text += delta_text
        if self.mode == "auto":
            return self._feed_auto(finished)
        _, calls = parse_calls(self.text, self.mode, self.named)
        return "", self._deltas(calls)

    def _feed_auto(self, finished: bool) -> tuple[str, list[dict]]:
        if not finished:
            hold = auto_hold_from(self.text)
            content = self.text[self.content_sent : max(hold, self.content_sent)]
            self.content_sent += len(content)
            return content, []
        content, calls = _parse_auto(self.text)
        calls = calls if self.parallel else calls[:1]
        if not calls:
            rest = self.text[self.content_sent :]
            self.content_sent = len(self.text)
            return rest, []
        # Content before the first call that is still held back goes out now.
        start = self.text.find(_TAG_OPEN)
        rest = self.text[self.content_sent : start] if start > self.content_sent else ""
        self.content_sent = len(self.text)
        return rest.rstrip(), self._deltas(calls)

    def _deltas(self, calls: list[ParsedCall]) -> list[dict]:
        deltas = []
        for k, call in enumerate(calls):
            if k == len(self.ids):
                self.ids.append(new_call_id())
                self.args_sent.append(len(call.arguments))
                deltas.append(
                    {
                        "index": k, "id": self.ids[k], "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                )  # fmt: skip
            elif len(call.arguments) > self.args_sent[k]:
                deltas.append({"index": k, "function": {"arguments": call.arguments[self.args_sent[k] :]}})
                self.args_sent[k] = len(call.arguments)
        return deltas
