"""Tool calling, request side: which mode a request is in, the constraint that forces a
valid call, and rendering tools and earlier calls through the chat template.

Modes: "none" (tools ignored), "auto" (the model may call; its output is parsed afterwards),
"required" (output constrained to a JSON array of {"name", "arguments"} calls for the declared
tools) and "named" (output constrained to that function's arguments object).
"""

from __future__ import annotations

import json
from typing import Any

from kvserve.entrypoints.openai.errors import shown_json
from kvserve.entrypoints.openai.message_rules import check_message, check_tool_turns
from kvserve.entrypoints.openai.protocol import (
    AllowedToolsChoice,
    ChatCompletionRequest,
    ChatMessage,
    FunctionDefinition,
    NamedToolChoice,
    TokenizeRequest,
    ToolCall,
    checked,
)
from kvserve.entrypoints.openai.tool_refs import placed
from kvserve.sampling_params import StructuredOutputsParams

ANY_OBJECT: dict[str, Any] = {"type": "object"}

# For chat templates that know nothing of tools (SmolLM2-135M's, for one): the Hermes /
# Qwen2 convention, which SmolLM2 was also trained on.
TOOLS_SYSTEM_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
    "Here are the available tools:\n<tools>\n{tools}\n</tools>\n"
    "For each function call, return a json object with the function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": '
    "<args-json-object>}}\n</tool_call>"
)


def check_unique_names(functions: list[FunctionDefinition], field: str) -> None:
    """Refuse two functions of one name, as OpenAI does (naming `field`): a call names its
    function, so one of the two could never be told apart, and a forced call took the last
    one's parameters while the model was shown both."""
    first: dict[str, int] = {}
    for i, f in enumerate(functions):
        if f.name in first:
            raise ValueError(
                f"{field}: function name {f.name!r} is declared twice ({field}[{first[f.name]}] and "
                f"{field}[{i}]); tool names must be unique"
            )
        first[f.name] = i


def check_object_parameters(functions: list[FunctionDefinition], field: str) -> None:
    """Refuse parameters of a type other than object, as OpenAI does (naming `field`): a call's
    arguments are a JSON object, and a forced call under {"type": "string"} had '"f"' for its
    arguments."""
    for i, f in enumerate(functions):
        kind = (f.parameters or {}).get("type", "object")
        if kind != "object":
            raise ValueError(
                f'{field}: the parameters of {field}[{i}] ({f.name!r}) must be a JSON Schema of "type": '
                f'"object" (a call\'s arguments are an object), not {kind!r}'
            )


def restrict_to_allowed(req: ChatCompletionRequest) -> None:
    """An allowed_tools choice as the plain one it means: the tools cut to those it names, and
    its mode ("auto" or "required") as tool_choice. Its names must be among the tools."""
    choice = req.tool_choice
    if not isinstance(choice, AllowedToolsChoice):
        return
    names = [t.function.name for t in choice.allowed_tools.tools]
    if not names:
        raise ValueError("tool_choice: allowed_tools.tools is empty; name at least one of the tools")
    declared = {t.function.name for t in req.tools or []}
    missing = [n for n in names if n not in declared]
    if missing:
        raise ValueError(f"tool_choice: allowed_tools names {missing[0]!r}, which is not among the tools")
    req.tools = [t for t in req.tools or [] if t.function.name in names]
    req.tool_choice = choice.allowed_tools.mode


def tool_mode(req: ChatCompletionRequest) -> str:
    """ "none" | "auto" | "required" | "named"; validates tool_choice against the tools."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise ValueError("tool_choice: requires tools")
        return "none"
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {t.function.name for t in req.tools}:
            raise ValueError(f"tool_choice: function {choice.function.name!r} is not among the tools")
        mode = "named"
    else:
        mode = choice or "auto"
    # A forced call leaves no text reply for response_format to shape, so the call's own
    # constraint wins (OpenAI accepts both; instructor's Responses mode sends both). vLLM's
    # structured_outputs constrains the raw output, which the call constraint would replace.
    if mode in ("named", "required") and req.structured_outputs is not None:
        raise ValueError("tool_choice: a forced tool call cannot be combined with structured_outputs")
    return mode


def call_constraint(req: ChatCompletionRequest, mode: str) -> StructuredOutputsParams | None:
    """The JSON schema a forced call must match (None unless mode is required or named). Each
    forced tool's parameters are checked alone first, so a refusal names the tool and points into
    its parameters ("maximum at /items/anyOf/1/properties/arguments/properties/n" named neither)."""
    tools = {t.function.name: t.function.parameters or ANY_OBJECT for t in req.tools or []}
    if mode not in ("named", "required"):
        return None
    for name, params in tools.items():  # by name: allowed_tools and the Responses API renumber tools
        if mode == "required" or name == req.tool_choice.function.name:
            checked(StructuredOutputsParams(json=params), f"tools: function {name!r} parameters")
    if mode == "named":
        schema = tools[req.tool_choice.function.name]
    else:
        defs: dict[str, Any] = {}  # parameters with local $refs, placed where those still point
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": placed(params, f"tool{i}", defs)},
                "required": ["name", "arguments"],
            }
            for i, (name, params) in enumerate(tools.items())
        ]
        schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
        if not req.parallel_tool_calls:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
    return checked(StructuredOutputsParams(json=schema), "tools")


def conversation(
    req: ChatCompletionRequest | TokenizeRequest, template: str
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template kwargs). A template that uses `tools` gets them natively;
    otherwise tools go into the system prompt and earlier calls into the assistant text.
    `developer` (OpenAI's newer name for the system role) is rendered as `system` unless the
    template knows the role, so it replaces the template's default system prompt. The legacy
    `functions` turns (an assistant's `function_call`, a `function` message with its `name`)
    render as a tool call and a tool result, which have no id to tie them."""
    native = "tools" in template or "tool_calls" in template
    developer = "system" if "developer" not in template else "developer"
    messages = []
    for i, m in enumerate(req.messages):
        check_message(i, m)
        role = {"developer": developer, "function": "tool"}.get(m.role, m.role)
        msg: dict[str, Any] = {"role": role, "content": m.text() or _refusal(m)}
        if m.name:
            msg["name"] = m.name
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        tool_calls = m.tool_calls or ([ToolCall(function=m.function_call)] if m.function_call else [])
        if tool_calls:
            one = [f"tool_calls[{j}]" for j in range(len(tool_calls))] if m.tool_calls else ["function_call"]
            where = [f"message {i} ({m.role}) {n}" for n in one]
            calls = [
                {"name": c.function.name, "arguments": _as_object(c.function.arguments, w)}
                for c, w in zip(tool_calls, where)
            ]
            if native:
                msg["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": f} for c, f in zip(tool_calls, calls)
                ]
            else:
                text = "\n".join(
                    f"<tool_call>\n{json.dumps(f, ensure_ascii=False)}\n</tool_call>" for f in calls
                )
                msg["content"] = f"{msg['content']}\n{text}" if msg["content"] else text
        messages.append(msg)
    check_tool_turns(req.messages)
    if not req.tools or getattr(req, "tool_choice", None) == "none":
        return messages, {}
    specs = [t.model_dump(exclude_none=True) for t in req.tools]
    if native:
        return messages, {"tools": specs}
    prompt = TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(s, ensure_ascii=False) for s in specs))
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
    else:
        messages.insert(0, {"role": "system", "content": prompt})
    return messages, {}


def _refusal(m: ChatMessage) -> str:
    """A reply that refused comes back with content null and its text as `refusal` (as the API
    answers it): the model reads that text as the turn's, not an empty turn."""
    text = getattr(m, "refusal", None)
    return text if m.role == "assistant" and isinstance(text, str) else ""


def _as_object(arguments: str | dict, where: str) -> Any:
    """A call's arguments as the template reads them; `where` names the call in the error
    ("message 1 (assistant) tool_calls[0]": the bare "tool_calls arguments" named no message)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        raise ValueError(f"messages: {where} arguments are not valid JSON: {shown_json(arguments)}") from None
