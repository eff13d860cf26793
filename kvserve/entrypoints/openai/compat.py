"""What clients send beyond the core fields, reduced to what the handlers act on.

SDKs and frameworks send fields by default that a text model cannot or need not act on, and
older clients use names that have since moved (legacy `functions`, vLLM's `guided_*`). Here
each request is brought to one canonical form before it is served: legacy names mapped onto
their successors (with a deprecation Warning header), informational fields dropped with a
debug line, and fields that would change the output in a way kvserve cannot honour refused
with a 400 that says why, rather than ignored.
"""

from __future__ import annotations

import logging

from kvserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatTool,
    CompletionRequest,
    NamedToolChoice,
    SamplingFields,
    StructuredOutputs,
)
from kvserve.entrypoints.openai.tools import check_object_parameters, check_unique_names, restrict_to_allowed

logger = logging.getLogger("kvserve.server")

INFORMATIONAL = (
    "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier", "user",
    "reasoning_effort", "verbosity", "prediction",
)  # fmt: skip
GUIDED = {
    "guided_json": "json", "guided_choice": "choice", "guided_regex": "regex", "guided_grammar": "grammar",
}  # fmt: skip


class ModelNotFoundError(LookupError):
    """The request names a model this server does not serve (404 model_not_found, as OpenAI)."""


def normalize_sampling(req: SamplingFields) -> list[str]:
    """Shared by chat and completions. Returns the Warning header values to send back."""
    if req.use_beam_search and req.stream:
        raise ValueError("stream: beam search returns whole sequences only (as vLLM's); set stream to false")
    if req.use_beam_search and req.best_of is not None and req.best_of != req.n:
        raise ValueError("best_of: with use_beam_search, n is the beam width; leave best_of unset")
    if req.best_of is not None and req.best_of < req.n:
        raise ValueError(f"best_of: must be at least n (got best_of={req.best_of}, n={req.n})")
    if req.best_of is not None and req.best_of > req.n and req.stream:
        raise ValueError("best_of: cannot be streamed (the best are known only at the end); use n")
    if not req.spaces_between_special_tokens:  # vLLM's fast detokenizer does not honour it either
        raise ValueError("spaces_between_special_tokens: false is not supported: the text is decoded as is")
    if req.prompt_logprobs is not None and req.stream:  # no chunk carries them: they were dropped unsaid
        raise ValueError("prompt_logprobs: not available when stream is true (as vLLM's); send stream false")
    ignored = [f for f in INFORMATIONAL if getattr(req, f, None) is not None]
    if ignored:
        logger.debug("ignoring informational fields: %s", ", ".join(ignored))
    warnings = []
    guided = {GUIDED[f]: getattr(req, f) for f in GUIDED if getattr(req, f) is not None}
    if guided:
        old = ", ".join(f for f in GUIDED if getattr(req, f) is not None)
        if req.structured_outputs is not None:
            raise ValueError(f"{old.split(',')[0]}: cannot be combined with structured_outputs")
        req.structured_outputs = StructuredOutputs.model_validate(guided)
        req.constraint_field = old.split(",")[0]  # its errors name the field the client sent
        warnings.append(f'299 kvserve "{old} deprecated: use structured_outputs"')
    return warnings


def normalize_chat(req: ChatCompletionRequest) -> list[str]:
    warnings = normalize_sampling(req)
    both = (req.max_tokens, req.max_completion_tokens)
    if None not in both and both[0] != both[1]:  # OpenAI refuses the pair; vLLM takes the newer name
        warnings.append(
            f'299 kvserve "max_tokens ({both[0]}) ignored: max_completion_tokens ({both[1]}) is set"'
        )
    if req.modalities and "audio" in req.modalities:
        raise ValueError("modalities: this server produces text only; audio output is not supported")
    if req.audio is not None:  # (named `modalities` before, a field the request may not have sent)
        raise ValueError("audio: this server produces text only; audio output is not supported")
    if req.chat_template is not None:  # a client's Jinja run in the server: vLLM too refuses it by default
        raise ValueError(
            "chat_template: a request's own chat template is not run here (vLLM refuses it too unless "
            "started with --trust-request-chat-template); the model's template is used, and "
            "chat_template_kwargs passes variables to it"
        )
    if req.web_search_options is not None:
        raise ValueError("web_search_options: web search is not available on this server")
    for field in ("tools", "functions"):  # OpenAI's 400: an empty list declares nothing to call
        if getattr(req, field) == []:
            raise ValueError(f"{field}: empty array; send at least one, or leave {field} out")
    if "parallel_tool_calls" in req.model_fields_set and req.tools is None and req.functions is None:
        raise ValueError("parallel_tool_calls: only allowed when tools are specified (as OpenAI's)")
    if req.function_call is not None and req.functions is None:
        raise ValueError("function_call: requires functions")
    if req.functions is not None:
        if req.tools is not None or req.tool_choice is not None:
            raise ValueError("functions: cannot be combined with tools / tool_choice (use tools)")
        check_unique_names(req.functions, "functions")
        check_object_parameters(req.functions, "functions")
        req.tools = [ChatTool(function=f) for f in req.functions]
        fc = req.function_call
        req.tool_choice = fc if fc is None or isinstance(fc, str) else NamedToolChoice(function=fc)
        req.parallel_tool_calls = False  # a legacy reply holds one function_call
        warnings.append('299 kvserve "functions and function_call deprecated: use tools and tool_choice"')
    check_unique_names([t.function for t in req.tools or []], "tools")  # before allowed_tools cuts them
    check_object_parameters([t.function for t in req.tools or []], "tools")
    restrict_to_allowed(req)  # allowed_tools: the tools it names, in its mode
    if req.continue_final_message and req.messages[-1].role != "assistant":
        raise ValueError("continue_final_message: the last message must be the assistant's")
    explicit_prompt = req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set
    if req.continue_final_message and explicit_prompt:
        raise ValueError("continue_final_message: cannot be combined with add_generation_prompt=true")
    return warnings


def normalize_completion(req: CompletionRequest) -> list[str]:
    if req.suffix:
        raise ValueError("suffix: this model has no fill-in-the-middle support; send the prompt only")
    return normalize_sampling(req)


def continues_final_message(req: ChatCompletionRequest) -> bool:
    """Prefill: the reply extends the last assistant message instead of opening a new turn,
    when asked (continue_final_message) or when the conversation ends with the assistant's
    text and the client did not explicitly ask for a generation prompt."""
    if not req.messages:
        return False
    last = req.messages[-1]
    if req.continue_final_message:
        return True
    explicit = "add_generation_prompt" in req.model_fields_set and req.add_generation_prompt
    called = last.tool_calls or last.function_call
    return last.role == "assistant" and not called and bool(last.text()) and not explicit
