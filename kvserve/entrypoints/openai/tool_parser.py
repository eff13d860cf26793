"""Tool calling, response side: finding calls in the generated text, whole or streamed.

`parse_calls` reads the text as it stands (possibly cut short): forced modes produce JSON
we constrained, "auto" looks for the chat template's formats — `<tool_call>{...}</tool_call>`
blocks (Hermes / Qwen2 / SmolLM2, a list inside one block is accepted too) or a bare JSON
call as Llama 3 writes it ({"name", "parameters"}). In "auto" only a call to a declared tool
counts (a JSON answer with a "name" key is an answer), and the content is the text outside
the calls, trimmed. `ToolCallStream` turns the growing text into OpenAI's streamed content
and tool-call deltas; concatenated, they equal the non-streamed content and calls.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_TAG_OPEN, _TAG_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text (a prefix of it while the call is still being generated)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_calls(
    text: str, mode: str, named: str | None = None, declared: Collection[str] = (), cut: bool = False
) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) for this mode's output so far; `declared`: the request's tool names;
    `cut`: max_tokens ended the text (finish_reason "length")."""
    if mode == "named":
        return None, [ParsedCall(named or "", text)]
    if mode == "required":
        return None, _parse_array(text)
    return _parse_auto(text, declared, cut)


def _parse_array(text: str) -> list[ParsedCall]:
    """Calls of `[{"name": ..., "arguments": {...}}, ...]`, the last one possibly incomplete: once
    its name is written, with the arguments so far, "" before they begin (a call max_tokens cut
    between its name and its arguments was left out, the reply holding no call at all)."""
    i = len(text) - len(text.lstrip())
    if not text.startswith("[", i):
        return []
    i += 1
    calls = []
    while True:
        m = _HEAD.match(text, i)
        if m is None:
            named = _named_only(text, i)
            calls += [ParsedCall(named, "")] if named is not None else []
            break
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


def _named_only(text: str, i: int) -> str | None:
    """The name of a call at text[i] that ends after its name, in the text before its arguments
    (`{"name": "f", "argu`), else None."""
    m = _NAME.match(text, i)
    if m is None or not _before_arguments(text[m.end() :]):
        return None
    try:
        return json.loads(f'"{m.group(1)}"')
    except ValueError:
        return None


def _before_arguments(rest: str) -> bool:
    """Whether `rest` is what stands between a call's name and its arguments where the text ends
    there: a prefix of `, "arguments": ` with any spacing."""
    return ',"arguments":'.startswith(re.sub(r"\s+", "", rest))


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


def _calls_from_json(obj, declared: Collection[str]) -> list[ParsedCall]:
    """The calls in a parsed block, or [] unless every item calls a declared tool."""
    items = obj if isinstance(obj, list) else [obj]
    calls = []
    for it in items:
        if not isinstance(it, dict) or not isinstance(it.get("name"), str) or it["name"] not in declared:
            return []
        args = it.get("arguments", it.get("parameters", {}))
        calls.append(
            ParsedCall(it["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
        )
    return calls


def _parse_auto(
    text: str, declared: Collection[str], cut: bool = False
) -> tuple[str | None, list[ParsedCall]]:
    """Calls and the text around them; any block that is not a call leaves all as content.
    When `cut`, an unclosed last block is the call max_tokens interrupted, as forced modes and
    OpenAI return it: its arguments so far ("" when cut before they begin, as a forced call's)
    when its declared name was written, else left out (its markup was sent as content:
    '<tool_call>\\n{"name": "get_')."""
    if _TAG_OPEN in text:
        blocks = list(_BLOCK.finditer(text))
        bodies = [m.group(1) for m in blocks]
        content = _BLOCK.sub("", text).strip() or None
        open_last = cut and bool(blocks) and not blocks[-1].group(0).endswith(_TAG_CLOSE)
    else:
        bodies, content, open_last = [text.strip()], None, False  # a bare JSON call, as Llama 3 writes it
    calls = []
    for k, body in enumerate(bodies):
        try:
            found = _calls_from_json(json.loads(body), declared)
        except ValueError:
            found = []
            if open_last and k == len(bodies) - 1:
                interrupted = _interrupted_call(body, declared)
                if interrupted is not False:
                    calls += [interrupted] if interrupted else []
                    continue
        if not found:
            return text.strip(), []
        calls += found
    return content, calls


def _interrupted_call(body: str, declared: Collection[str]) -> ParsedCall | None | bool:
    """The call a cut block was writing: its arguments so far ("" where it ends before them;
    None: its name not written whole, or followed by no arguments' key);
    False when it names an undeclared tool (then the text is no call, as whole blocks)."""
    named = _NAME.match(body)
    try:
        name = json.loads(f'"{named.group(1)}"') if named else None
    except ValueError:  # an escape JSON has not ("\\x"): no name written
        name = None
    if name is not None and name not in declared:
        return False
    head = _HEAD.match(body)
    if name is None:
        return None
    if head is None:  # cut between the name and the arguments: a forced call's "" (_parse_array)
        return ParsedCall(name, "") if _before_arguments(body[named.end() :]) else None
    end = json_value_end(body, head.end())
    return ParsedCall(name, body[head.end() : end or len(body)])


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

    def __init__(
        self, mode: str, named: str | None = None, parallel: bool = True, declared: Collection[str] = ()
    ) -> None:
        self.mode, self.named, self.parallel, self.declared = mode, named, parallel, declared
        self.text = ""
        self.content_sent = 0  # characters of the content (not of the text) sent
        self.ids: list[str] = []
        self.args_sent: list[int] = []

    def feed(self, delta_text: str, finished: bool, cut: bool = False) -> tuple[str, list[dict]]:
        """(content delta, tool-call deltas) after this piece of text; `cut`: max_tokens ended it."""
        self.text += delta_text
        if self.mode == "auto":
            return self._feed_auto(finished, cut)
        _, calls = parse_calls(self.text, self.mode, self.named)
        return "", self._deltas(calls)

    def _feed_auto(self, finished: bool, cut: bool = False) -> tuple[str, list[dict]]:
        """Text before anything that may become a call goes out as it comes, less the
        whitespace at its ends (trimmed from the final content if nothing else follows);
        the rest waits for the finished text, parsed as `parse_calls` parses it."""
        if finished:
            content, calls = _parse_auto(self.text, self.declared, cut)
            deltas = self._deltas(calls if self.parallel else calls[:1])
        else:
            content, deltas = self.text[: auto_hold_from(self.text)].strip(), []
        new = (content or "")[self.content_sent :]
        self.content_sent += len(new)
        return new, deltas

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
