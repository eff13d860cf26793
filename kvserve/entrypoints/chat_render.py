"""The offline `LLM.chat` template call, with vLLM's options and errors that name the field."""

from __future__ import annotations

import json
from typing import Any

from kvserve.entrypoints.openai.message_rules import READABLE
from kvserve.tokenizer import Tokenizer, template_call_parameters


def render_chat(
    tokenizer: Tokenizer,
    conversation: list[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    content_format: str = "auto",
) -> str:
    """The conversation as prompt text. As vLLM, continue_final_message needs
    add_generation_prompt=False and a last message from the assistant, whose text the reply
    then extends (no end-of-turn token after it)."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message: cannot be combined with add_generation_prompt=True")
    if continue_final_message and (not conversation or conversation[-1].get("role") != "assistant"):
        raise ValueError("continue_final_message: the last message must be the assistant's")
    if content_format not in ("auto", "string", "openai"):
        raise ValueError(
            f"chat_template_content_format: must be auto, string or openai, got {content_format!r}"
        )
    conversation = [
        _with_call_objects(_flattened(m, i, keep_parts=content_format == "openai"), i)
        for i, m in enumerate(conversation)
    ]
    extra = dict(chat_template_kwargs or {})
    reserved = sorted(template_call_parameters() & extra.keys())
    if reserved:
        raise ValueError(f"chat_template_kwargs: {', '.join(reserved)} cannot be set (an argument of chat())")
    if chat_template is not None:
        extra["chat_template"] = chat_template
    elif not tokenizer.hf.chat_template:
        raise ValueError("chat_template: this model has none; pass one (a Jinja template string)")
    if continue_final_message:
        extra["continue_final_message"] = True
    if tools is not None:
        extra["tools"] = tools
    try:
        return tokenizer.hf.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )
    except Exception as e:  # a template's error (a role it refuses, a bad Jinja string) names no field
        raise ValueError(f"messages: the chat template rejected them: {e}") from None


def _flattened(message: dict[str, Any], i: int, keep_parts: bool = False) -> dict[str, Any]:
    """A message whose content is OpenAI's list of parts, with the text parts joined by newlines,
    as vLLM's LLM.chat joins them for a template that reads content as a string (they were
    joined with "", so ["Hello.", "Bye."] read "Hello.Bye."); a template rendered the list as
    its Python repr ("[{'type': 'text', ...}]"), images included."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = READABLE.get(kind)
        if key is None or not isinstance(part.get(key), str):
            raise ValueError(f"messages[{i}].content[{j}]: type {kind!r} is not supported (text parts only)")
        texts.append(part[key])
    if keep_parts:  # vLLM's "openai" format: the template iterates over the (text) parts
        return message
    return {**message, "content": "\n".join(texts)}


def _with_call_objects(message: dict[str, Any], i: int) -> dict[str, Any]:
    """An assistant message whose tool calls' `arguments` are OpenAI's JSON strings, with them as
    objects (none or "" as {}), as vLLM's LLM.chat and the server hand them to the template:
    templates write `arguments | tojson`, which rendered the string quoted and escaped again."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if message.get("role") != "assistant" or not isinstance(calls, list):
        return message
    parsed = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or isinstance(function.get("arguments"), dict | list):
            parsed.append(call)
            continue
        try:
            arguments = json.loads(function["arguments"]) if function.get("arguments") else {}
        except (TypeError, ValueError):
            shown = repr(function["arguments"])[:80]
            raise ValueError(
                f"messages[{i}].tool_calls[{j}].function.arguments: not valid JSON: {shown}"
            ) from None
        parsed.append({**call, "function": {**function, "arguments": arguments}})
    return {**message, "tool_calls": parsed}
