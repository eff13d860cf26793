"""The Responses API request (POST /v1/responses), and its translation to a chat request.

A response is a chat completion in another envelope: `input` (a string or a list of items)
and `instructions` become messages, flat function tools become chat tools, `text.format`
becomes response_format, and `previous_response_id` prepends the stored conversation that
response ended. Keeping one engine path means the Responses API gets every chat feature
(structured outputs, tool parsing, logprob rules) without a second implementation.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from kvserve.entrypoints.openai.errors import EmptyStringError, shown_json
from kvserve.entrypoints.openai.limits import Int64, Metadata, NonNegInt64, NumLogprobs, PositiveInt64
from kvserve.entrypoints.openai.protocol import (
    AllowedTools,
    AllowedToolsChoice,
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    FunctionDefinition,
    FunctionName,
    JsonSchemaFormat,
    NamedToolChoice,
    OpenAIBody,
    ReasoningEffort,
    ResponseFormat,
    ServiceTier,
    ToolChoiceFunction,
    tool_choice_union,
)
from kvserve.tokenizer import lone_surrogate

# OpenAI's `include` values (ResponseIncludable): what GET .../input_items may ask for
Includable = Literal[
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
    "reasoning.encrypted_content", "message.output_text.logprobs",
]  # fmt: skip


class FunctionTool(OpenAIBody):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(OpenAIBody):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class AllowedFunctions(OpenAIBody):
    """OpenAI's allowed_tools choice in the Responses API's (flat) form."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[FunctionChoice]


ResponsesToolChoice = tool_choice_union(FunctionChoice, AllowedFunctions)


class TextFormat(OpenAIBody):
    """OpenAI's text.format: its name, description, schema and strict belong to type json_schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: FunctionName | None = None  # OpenAI's rule, as chat's response_format.json_schema.name
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _fields_of_json_schema(self) -> TextFormat:
        """A schema (or name) sent with type json_object or text was dropped unsaid: the answer
        was any JSON object, or free text, where the client believed it held to the schema."""
        given = [f for f in ("name", "description", "schema_", "strict") if getattr(self, f) is not None]
        if given and self.type != "json_schema":
            shown = given[0].rstrip("_")
            raise ValueError(f"{shown} is only used with type json_schema, not {self.type!r}")
        return self


class TextConfig(OpenAIBody):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # informational


class ReasoningConfig(OpenAIBody):
    """OpenAI's `reasoning`: informational (no reasoning model), its values checked as OpenAI
    checks them; keys OpenAI adds (mode, context, ...) taken as they come."""

    model_config = ConfigDict(extra="allow")
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # deprecated name of summary


class ResponsesStreamOptions(OpenAIBody):
    model_config = ConfigDict(extra="forbid")
    include_obfuscation: bool = True  # no obfuscation field is sent either way: informational


class ResponsesRequest(OpenAIBody):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    null_means_default: ClassVar[frozenset[str]] = frozenset(
        {"parallel_tool_calls", "stream", "store", "background"}
    )

    model: str | None = None
    # OpenAI's is optional (a stored prompt can stand for it); this server needs it (to_chat), but
    # refuses the prompt first, saying so, rather than reporting input missing
    # items are checked one by one (input_messages): typed as objects here, a list holding a
    # string was refused as "input: Input should be a valid string", naming no item
    input: str | list[Any] | None = None
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ResponsesToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: PositiveInt64 | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_logprobs: NumLogprobs | None = None
    seed: Int64 | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool = True
    previous_response_id: str | None = None
    max_tool_calls: NonNegInt64 | None = None  # function calls kept in the output (responses.py)
    # informational, or features refused with a reason (see refuse_unsupported)
    metadata: Metadata | None = None
    user: str | None = None
    service_tier: ServiceTier | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: ReasoningConfig | None = None
    include: list[Includable] | None = None  # (an unknown value was taken silently)
    background: bool = False
    # OpenAI's server-side state that kvserve does not keep: declared so that they are refused
    # with the reason (refuse_unsupported), not as unknown fields
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None


class InputTokensRequest(OpenAIBody):
    """OpenAI's POST /v1/responses/input_tokens body: what shapes a response's prompt, and
    nothing about its generation (max_output_tokens, stream, ... are unknown fields there)."""

    model_config = ConfigDict(extra="forbid")
    null_means_default: ClassVar[frozenset[str]] = frozenset({"parallel_tool_calls"})

    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ResponsesToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    conversation: Any = None  # (refused as create refuses it)

    def as_response_request(self) -> ResponsesRequest:
        return ResponsesRequest(**{name: getattr(self, name) for name in self.model_fields_set})


def _text_of(content: Any, where: str, assistant: bool = False) -> str:
    """An item's content as text: a string, or input_text / output_text parts joined by
    newlines (as a chat message's parts are: ChatMessage.text). An assistant's (an output
    message passed back) may hold OpenAI's refusal part: its refusal is what was said."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(f"input: {where} content must be a string or a list of parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" and assistant else "text"
        if kind not in ("input_text", "output_text", "text") and key == "text":
            raise ValueError(f"input: content part type {kind!r} is not supported (text only)")
        if not isinstance(part.get(key), str):  # a missing text was read as "", unsaid (chat refuses it)
            got = "missing" if key not in part else type(part[key]).__name__
            raise ValueError(f"input: {where} has a {kind} part that needs {key}, a string (got {got})")
        texts.append(part[key])
    return "\n".join(texts)


def input_messages(items: str | list[Any], history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Response input items -> chat messages (function calls and their outputs included). A
    function_call_output answers a function_call before it, in `items` or the previous
    response's `history` (OpenAI's rule, checked here to name the item); every call is
    answered, the previous response's too."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    called = {c.get("id") for m in history for c in m.get("tool_calls") or []}
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"input: item {i} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ValueError(f"input: item {i} has role {role!r}")
            if item.get("content") is None:  # as OpenAI: a message item carries its content
                raise ValueError(f"input: item {i} (message) needs content, a string or a list of parts")
            content = _text_of(item["content"], f"item {i}", assistant=role == "assistant")
            messages.append({"role": role, "content": content})
        elif kind == "function_call":
            _require_strings(item, i, ("name", "call_id"))
            if not isinstance(item.get("arguments", "{}"), str):  # reached the chat model as a pydantic dump
                raise ValueError(f"input: item {i} (function_call) arguments must be a string of JSON")
            _require_json(item.get("arguments", "{}"), i)
            fn = {"name": item["name"], "arguments": item.get("arguments", "{}")}
            call = {"id": item.get("call_id"), "type": "function", "function": fn}
            called.add(item["call_id"])
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            _require_strings(item, i, ("call_id",))
            text = _output_text(item.get("output"), i)
            if item["call_id"] not in called:
                raise ValueError(
                    f"input: item {i} (function_call_output) has call_id {item['call_id']!r}, which no "
                    "function_call before it has (in input, or complete in the previous response's output)"
                )
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "reasoning":  # a reasoning model's earlier turn passed back: this model has none
            continue
        else:
            raise ValueError(f"input: item type {kind!r} is not supported")
    _require_outputs(history + messages)
    return messages


def _require_outputs(conversation: list[dict[str, Any]]) -> None:
    """Every function call answered by a function_call_output, as OpenAI requires ("No tool
    output found for function call ..."): one left open reached the model as a call that
    never returned, and the answer went on as if it had."""
    answered = {m.get("tool_call_id") for m in conversation if m.get("role") == "tool"}
    for m in conversation:
        for call in m.get("tool_calls") or []:
            if call["id"] not in answered:
                raise ValueError(
                    f"input: No tool output found for function call {call['id']!r}; send a "
                    "function_call_output item with that call_id"
                )


def _output_text(output: Any, index: int) -> str:
    """A function_call_output's output as the tool message's text: a string, or (OpenAI's other
    form) a list of content parts read as their text; another JSON value as its JSON."""
    if output is None:
        raise ValueError(
            f"input: item {index} (function_call_output) needs output (a string or a list of parts)"
        )
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _text_of(output, f"item {index} output")
    return json.dumps(output)


def _require_json(arguments: str, index: int) -> None:
    """Checked here, where the item's index is known: the chat path's check named a chat
    message ("input: message 1 (assistant) tool_calls[0] ..."), not the input item."""
    try:
        json.loads(arguments)
    except ValueError:
        why = f"arguments are not valid JSON: {shown_json(arguments)}"
        raise ValueError(f"input: item {index} (function_call) {why}") from None


def _require_strings(item: dict[str, Any], index: int, keys: tuple[str, ...]) -> None:
    for key in keys:
        if not isinstance(item.get(key), str) or not item[key]:
            raise ValueError(f"input: item {index} ({item['type']}) needs {key}, a non-empty string")


def refuse_unsupported(req: ResponsesRequest) -> None:
    """A 400 saying why for the features that need state or models this server does not have. Checked
    before to_chat: the chat path's errors naming `prompt` are renamed to `input`, this one not."""
    if req.background:
        raise ValueError("background: background responses are not supported; use stream=true")
    if req.conversation is not None:
        raise ValueError(
            "conversation: conversations are not supported by this server; "
            "continue a response with previous_response_id instead"
        )
    if req.prompt is not None:
        raise ValueError(
            "prompt: stored prompt templates are not supported by this server; send input and instructions"
        )
    if req.context_management:
        raise ValueError("context_management: compaction is not supported by this server")
    if req.moderation is not None:
        raise ValueError("moderation: moderation is not supported by this server")
    if req.stream_options is not None and not req.stream:  # as the chat path answers it
        raise ValueError("stream_options: only allowed when stream is true")


def to_chat(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request this response runs as; `history` is the stored conversation of the
    previous response (its input and output), [] when there is none."""
    if req.input is None:
        raise ValueError("input: Field required (a string, or a list of input items)")
    if req.input == "":  # OpenAI's minimum length: a turn of nothing was answered as a prompt
        raise EmptyStringError("input: empty string; a string input needs at least one character")
    choice = req.tool_choice
    if req.max_tool_calls == 0 and req.tools:  # no call may be kept: the model answers in text
        mode = choice.mode if isinstance(choice, AllowedFunctions) else choice
        if mode not in (None, "auto", "none"):
            raise ValueError("max_tool_calls: 0 allows no call, but tool_choice requires one")
        choice = "none"
    messages = list(history)
    at = lone_surrogate(req.instructions or "")
    if at is not None:  # found in the rendered prompt it would be named input, a field it is not in
        bad = req.instructions[at]
        raise ValueError(f"instructions: not valid Unicode: a lone surrogate ({bad!a}) at character {at}")
    if req.instructions:  # instructions apply to this turn only (they are not carried forward)
        messages = [{"role": "system", "content": req.instructions}, *messages]
    messages += input_messages(req.input, history)
    if not messages:
        raise ValueError("input: must not be empty")
    fmt = req.text.format if req.text else None
    response_format = None
    if fmt is not None and fmt.type != "text":
        schema = None
        if fmt.type == "json_schema":
            if not fmt.schema_:
                raise ValueError("text: format.schema is required for type json_schema")
            if fmt.name is None:  # OpenAI's rule, as chat's ("response" was taken unsaid)
                raise ValueError("text: format.name is required for type json_schema")
            schema = JsonSchemaFormat(name=fmt.name, schema=fmt.schema_, strict=fmt.strict)
        response_format = ResponseFormat(type=fmt.type, json_schema=schema)
    if isinstance(choice, FunctionChoice):
        choice = NamedToolChoice(function=ToolChoiceFunction(name=choice.name))
    elif isinstance(choice, AllowedFunctions):
        named = [NamedToolChoice(function=ToolChoiceFunction(name=t.name)) for t in choice.tools]
        choice = AllowedToolsChoice(
            type="allowed_tools", allowed_tools=AllowedTools(mode=choice.mode, tools=named)
        )
    tools = None
    if req.tools:
        tools = [ChatTool(function=FunctionDefinition(**t.model_dump(exclude={"type"}))) for t in req.tools]
    return ChatCompletionRequest(
        model=req.model,
        messages=[ChatMessage.model_validate(m) for m in messages],
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        logprobs=req.top_logprobs is not None or "message.output_text.logprobs" in (req.include or []),
        top_logprobs=req.top_logprobs,
        tools=tools,
        tool_choice=choice,
        # only with tools: chat refuses it without them, as OpenAI's chat does (the Responses API
        # takes it either way, and echoes it)
        **({"parallel_tool_calls": req.parallel_tool_calls and req.max_tool_calls != 1} if tools else {}),
        response_format=response_format,
        stream=req.stream,
        stream_options={"include_usage": True} if req.stream else None,
    )
