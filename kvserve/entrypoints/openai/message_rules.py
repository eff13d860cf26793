"""What each chat role must and may carry, as OpenAI's chat reference has it.

The message body is one model for every role (a client's fields beyond these are allowed, as
SDKs echo a reply's own back: refusal, annotations, audio). What a role is given that only
another role means is refused rather than rendered into the prompt: a user message with
tool_calls would otherwise be shown to the model as calls the user made. Errors name the
message's index and field, and are raised before the template sees the conversation.
"""

from __future__ import annotations

from typing import Any

# The declared fields a role may set (not null); content is checked on its own.
ALLOWED: dict[str, frozenset[str]] = {
    "system": frozenset({"name"}),
    "developer": frozenset({"name"}),
    "user": frozenset({"name"}),
    "assistant": frozenset({"name", "tool_calls", "function_call"}),
    "tool": frozenset({"tool_call_id", "name"}),  # name: not OpenAI's, but sent by older frameworks
    "function": frozenset({"name"}),
}
ROLE_FIELDS = ("name", "tool_calls", "tool_call_id", "function_call")
# Content part types each role's content list may hold (OpenAI's); types this text-only server
# cannot read (image_url, input_audio, file) are refused later, as not supported.
PART_TYPES: dict[str, tuple[str, ...]] = {
    "user": ("text", "image_url", "input_audio", "file"),
    "assistant": ("text", "refusal"),
}
TEXT_ONLY = ("text",)
READABLE = {"text": "text", "refusal": "refusal"}  # part type -> the key holding its text


def check_message(i: int, m: Any) -> None:
    """Raise ValueError("messages: message i (role) ...") for what OpenAI refuses in message i."""
    where = f"messages: message {i} ({m.role})"
    for field in ROLE_FIELDS:
        if getattr(m, field) is not None and field not in ALLOWED[m.role]:
            raise ValueError(f"{where} may not have {field}{_owner(field)}")
    if m.role == "tool" and not m.tool_call_id:
        raise ValueError(f"{where} needs tool_call_id, the id of the call it answers")
    if m.role == "function" and not m.name:
        raise ValueError(f"{where} needs name, the function it answers")
    if m.tool_calls == []:  # OpenAI refuses it (empty_array) rather than reading it as no calls
        raise ValueError(
            f"{where} has tool_calls [] (messages[{i}].tool_calls takes at least one call; leave it out "
            "when there are none)"
        )
    if m.tool_calls and m.function_call:
        raise ValueError(f"{where} has both tool_calls and function_call")
    _check_content(where, m)


def check_tool_turns(messages: list[Any]) -> None:
    """Raise ValueError for a tool message that answers no call, as OpenAI does: each follows the
    assistant message whose tool_calls it answers (or another tool message answering it), and
    names one of those calls by id. The model would otherwise read a result of a call it never
    made. Calls sent without an id (not OpenAI's) are answered by any id."""
    calls: list[str | None] | None = None  # the ids the next tool message may answer; None: none
    for i, m in enumerate(messages):
        if m.role == "assistant" and m.tool_calls:
            calls = [c.id for c in m.tool_calls]
        elif m.role != "tool":
            calls = None
        elif calls is None:
            raise ValueError(
                f"messages: message {i} (tool) answers no call: a tool message follows the assistant "
                "message with the tool_calls it answers (or another tool message)"
            )
        elif None not in calls and m.tool_call_id not in calls:
            ids = ", ".join(repr(c) for c in calls)
            raise ValueError(
                f"messages: message {i} (tool) has tool_call_id {m.tool_call_id!r}, which is not among the "
                f"tool_calls of the assistant message before it ({ids})"
            )


def _owner(field: str) -> str:
    owners = [role for role, fields in ALLOWED.items() if field in fields]
    return f" (only {' and '.join(owners)} messages do)"


def _check_content(where: str, m: Any) -> None:
    if m.content is None:
        if m.role == "function" and "content" in m.model_fields_set:
            return  # the legacy function result's content is required but nullable
        calls = m.tool_calls or m.function_call or getattr(m, "refusal", None)
        if m.role == "assistant" and calls:
            return
        got = "null" if "content" in m.model_fields_set else "missing"
        alt = " or tool_calls" if m.role == "assistant" else ""
        raise ValueError(
            f"{where} needs content (a string or a list of content parts){alt}; content is {got}"
        )
    if isinstance(m.content, str):
        return
    if not m.content:
        raise ValueError(f"{where} has an empty content list (give at least one part, or a string)")
    allowed = PART_TYPES.get(m.role, TEXT_ONLY)
    for j, part in enumerate(m.content):
        kind = part.get("type")
        if kind not in allowed:
            kinds = ", ".join(allowed)
            raise ValueError(f"{where} content[{j}] has type {kind!r}; {m.role} messages take {kinds} parts")
        key = READABLE.get(kind)
        if key is None:
            raise ValueError(f"{where} content[{j}]: {kind} parts are not supported (this server reads text)")
        if not isinstance(part.get(key), str):
            got = "missing" if key not in part else type(part[key]).__name__
            raise ValueError(f"{where} content[{j}] ({kind}) needs {key}, a string (got {got})")
