"""OpenAI request bodies (pydantic) and their translation to SamplingParams.

Field policy: every field of OpenAI's chat / completions reference and vLLM's extras is
declared, so SDKs that send them by default work. Informational ones (store, metadata,
service_tier, ...) are accepted and ignored; ones that change behaviour are honoured or refused
with a 400 saying why (compat.py). Fields in neither reference are refused (extra="forbid"),
so a typo is a 400 naming it rather than being silently ignored. Numbers are range-checked
here (limits.py) and floats must be finite. Types are strict, as OpenAI's are: "stream": "yes",
"max_tokens": "5" or a boolean among token ids is a 400 naming the field, not coerced.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvserve.entrypoints.openai.limits import (
    MAX_BAD_WORDS,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    Int64,
    Metadata,
    NonNegInt64,
    NumChoices,
    PositiveInt64,
    ServedLogprobs,
    TopK,
)
from kvserve.entrypoints.openai.message_rules import READABLE
from kvserve.kv_transfer.params import check_kv_transfer_params
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.structured.spec import check as check_grammar


class OpenAIBody(BaseModel):
    """Every request body's base: no coercion between JSON types (an int stands for a float)."""

    model_config = ConfigDict(strict=True)
    # Fields OpenAI's reference declares nullable with a default ("n": null is n = 1): null
    # means the default there, and the openai client sends null for an argument given as None.
    null_means_default: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        nullable = cls.null_means_default
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in nullable):
            return {k: v for k, v in data.items() if not (v is None and k in nullable)}
        return data


# What an unset temperature / top_p samples with when the model's generation_config.json sets
# none (OpenAI's defaults): the Responses API echoes the value used.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0


class StreamOptions(OpenAIBody):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the usage so far


# OpenAI's rule for a function's and a response format's name: letters, digits, _ and -, at most 64
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]

# OpenAI's tiers: any is served by the one tier there is (reported "default"), another is a typo
# OpenAI refuses with a 400 naming the field, as vLLM's Responses API does
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]

# OpenAI's reasoning efforts (xhigh since GPT-5.2, max since GPT-5.6): informational here (no
# reasoning model), but a value OpenAI takes must not be a 400, and a typo is one
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class JsonSchemaFormat(OpenAIBody):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: FunctionName  # required, as OpenAI's and vLLM's (it was "response" unsaid); OpenAI's pattern
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # decoding is always constrained, strict or not


class ResponseFormat(OpenAIBody):
    """OpenAI's response_format: text (no constraint), any JSON object, or a JSON schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_only_for_json_schema(self) -> ResponseFormat:
        """A schema sent with type json_object or text was dropped unsaid: the answer was any JSON
        object, or free text, where the client believed it constrained to the schema."""
        if self.json_schema is not None and self.type != "json_schema":
            raise ValueError(f"json_schema is only used with type json_schema, not {self.type!r}")
        return self


class StructuredOutputs(OpenAIBody):
    """vLLM's `structured_outputs` extra field: exactly one constraint."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingFields(OpenAIBody):
    """Fields shared by chat and completions (OpenAI's plus vLLM's extras)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    null_means_default: ClassVar[frozenset[str]] = frozenset(
        {"n", "stream", "presence_penalty", "frequency_penalty", "logprobs", "echo", "parallel_tool_calls"}
    )

    model: str | None = None
    max_tokens: PositiveInt64 | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: NumChoices = 1
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Int64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    user: str | None = None  # informational
    # vLLM extras
    top_k: TopK | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=100)] | None = None
    min_tokens: NonNegInt64 = 0
    ignore_eos: bool = False
    stop_token_ids: list[NonNegInt64] | None = None
    allowed_token_ids: Annotated[list[NonNegInt64], Field(min_length=1)] | None = None  # only these sampled
    bad_words: Annotated[list[str], Field(max_length=MAX_BAD_WORDS)] | None = None  # never generated
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # vLLM's default, the only one here (compat.py)
    include_stop_str_in_output: bool = False
    priority: Int64 = 0  # lower runs sooner under --scheduling-policy priority
    cache_salt: str | None = None  # requests with different salts never share cached prefixes
    truncate_prompt_tokens: Int64 | None = None  # vLLM: keep the prompt's last k tokens (-1: max_model_len)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    request_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9._:-]{1,128}$")] | None = None  # response id suffix
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>"
    return_token_ids: bool = False  # vLLM: prompt_token_ids and each choice's token_ids in the answer
    prompt_logprobs: ServedLogprobs | None = None
    best_of: NumChoices | None = None  # samples drawn; the n of highest cumulative logprob returned
    use_beam_search: bool = False  # n beams, the n best returned (engine/beam_search.py); no streaming
    length_penalty: float = 1.0  # beam search only
    early_stopping: bool | Literal["never"] = False  # beam search only, as transformers'
    kv_transfer_params: dict[str, Any] | None = None  # prefill/decode disaggregation (kv_transfer/)
    # vLLM's deprecated names for structured_outputs (compat.py maps them, with a Warning header)
    guided_json: dict[str, Any] | str | None = None
    guided_choice: list[str] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    # OpenAI's informational fields: accepted, not acted on
    store: bool | None = None
    metadata: Metadata | None = None
    service_tier: ServiceTier | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # The field structured_outputs came from, for its errors (compat.py maps guided_* onto it).
    _constraint_field: str = PrivateAttr(default="structured_outputs")

    @property
    def constraint_field(self) -> str:
        return self._constraint_field

    @constraint_field.setter
    def constraint_field(self, name: str) -> None:
        self._constraint_field = name

    def output_constraint(self) -> StructuredOutputsParams | None:
        """response_format or structured_outputs as engine params; ValueError names the field."""
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.type != "text" and so is not None:
            raise ValueError("response_format: cannot be combined with structured_outputs")
        if so is not None:
            field = self._constraint_field
            try:
                params = StructuredOutputsParams(
                    json=so.json_, json_object=bool(so.json_object), regex=so.regex, choice=so.choice,
                    grammar=so.grammar,
                )  # fmt: skip
            except ValueError as e:
                raise ValueError(f"{field}:{str(e).partition(':')[2]}") from None
            return checked(params, field)
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise ValueError("response_format: json_schema.schema is required for type json_schema")
        return checked(StructuredOutputsParams(json=rf.json_schema.schema_), "response_format")

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        defaults: dict[str, Any] | None = None,
    ):
        """The engine's params; a field the request leaves unset takes `defaults`' value (the
        model's generation_config.json: kvserve/generation_defaults.py), else OpenAI's. Beam
        search takes none of them (a default repetition_penalty would refuse it)."""
        d = {} if defaults is None or self.use_beam_search else defaults
        if self.stream_options is not None and not self.stream:  # as OpenAI and vLLM answer it
            raise ValueError("stream_options: only allowed when stream is true")
        bias = None
        if self.logit_bias:
            # int() would also take " 5", "1_0" and other scripts' digits ("٣" is 3): not token ids
            bad = [k for k in self.logit_bias if not re.fullmatch(r"-?[0-9]+", k)]
            if bad:
                raise ValueError(f"logit_bias: keys must be token ids (decimal digits), got {bad[0]!r}")
            bias = {int(k): v for k, v in self.logit_bias.items()}
        return SamplingParams(
            n=self.n if self.use_beam_search else 1,  # beam search: each of the n requests is n wide
            temperature=d.get("temperature", DEFAULT_TEMPERATURE)
            if self.temperature is None
            else self.temperature,
            top_p=d.get("top_p", DEFAULT_TOP_P) if self.top_p is None else self.top_p,
            top_k=d.get("top_k", 0) if self.top_k is None else self.top_k,
            min_p=d.get("min_p", 0.0) if self.min_p is None else self.min_p,
            repetition_penalty=d.get("repetition_penalty", 1.0)
            if self.repetition_penalty is None
            else self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            max_tokens=d.get("max_tokens") if max_tokens is None else max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=bias,
            structured_outputs=self.output_constraint(),
            use_beam_search=self.use_beam_search,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            kv_transfer_params=self._kv_transfer_params(),
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )

    def _kv_transfer_params(self) -> dict | None:
        p = check_kv_transfer_params(self.kv_transfer_params)
        if p is not None and (self.n > 1 or (self.best_of or 1) > 1):
            raise ValueError("kv_transfer_params: needs n = 1 and no best_of")
        if p is not None and p.get("do_remote_decode") and self.stream:  # (vLLM's streams lack them too)
            raise ValueError(
                "kv_transfer_params: do_remote_decode needs stream false: the decode engine's parameters "
                "come in the response body, and the lease would be held for nobody until it expires"
            )
        return p


class FunctionDefinition(OpenAIBody):
    model_config = ConfigDict(extra="forbid")
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIBody):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(OpenAIBody):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(OpenAIBody):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class AllowedTools(OpenAIBody):
    """OpenAI's allowed_tools choice: calls restricted to these of the tools, in `mode`."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice]


class AllowedToolsChoice(OpenAIBody):
    model_config = ConfigDict(extra="forbid")
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


def _tool_choice_kind(value: Any) -> str | None:
    """The one member a tool_choice can be: a mode by being a string, else by its `type`
    (a missing type is a function's, as chat's NamedToolChoice defaults it). Tried in turn
    (pydantic's union), {"type": "function"} was refused by the first member, "Input should
    be 'none', 'auto' or 'required'", and the missing `function` was never named."""
    if isinstance(value, str):
        return "type=string"
    kind = value.get("type", "function") if isinstance(value, dict) else getattr(value, "type", None)
    return f"type={kind}" if kind in ("function", "allowed_tools") else None


def tool_choice_union(named: type, allowed: type) -> Any:
    """A tool_choice field's type: a mode, a named function or allowed tools, checked as the
    member its value says it is (the tags hold "=", so errors.field_path goes through them)."""
    return Annotated[
        Annotated[Literal["none", "auto", "required"], Tag("type=string")]
        | Annotated[named, Tag("type=function")]
        | Annotated[allowed, Tag("type=allowed_tools")],
        Discriminator(
            _tool_choice_kind,
            custom_error_type="tool_choice_type",
            custom_error_message=(
                "Input should be 'none', 'auto', 'required', "
                "or an object of type 'function' or 'allowed_tools'"
            ),
        ),
    ]


ToolChoice = tool_choice_union(NamedToolChoice, AllowedToolsChoice)


def _function_call_kind(value: Any) -> str:
    """The legacy function_call's member: a mode by being a string, else a function's name."""
    return "type=string" if isinstance(value, str) else "type=function"


FunctionCallChoice = Annotated[
    Annotated[Literal["none", "auto"], Tag("type=string")]
    | Annotated[ToolChoiceFunction, Tag("type=function")],
    Discriminator(_function_call_kind),
]


class ToolCallFunction(OpenAIBody):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(OpenAIBody):
    """An assistant message's earlier call, sent back in a follow-up conversation."""

    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


def checked(so: StructuredOutputsParams, field: str) -> StructuredOutputsParams:
    """Parse the grammar now, so an invalid one is a 400 naming `field` and the problem."""
    try:
        check_grammar(so)
    except ValueError as e:
        raise ValueError(f"{field}:{str(e).partition(':')[2]}") from None
    return so


class ChatMessage(OpenAIBody):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool", "function"]  # function: legacy tool
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: ToolCallFunction | None = None  # legacy: an assistant's one call

    def text(self) -> str:
        """Content as plain text: text parts, and an assistant's refusal parts, joined by
        newlines as vLLM joins them for a template that reads content as a string (and as
        `LLM.chat` does: chat_render.py)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:  # checked by message_rules before the template renders them
            key = READABLE.get(part.get("type"))
            if key is None or not isinstance(part.get(key), str):
                raise ValueError(f"messages: content part type {part.get('type')!r} is not supported")
            parts.append(part[key])
        return "\n".join(parts)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt64 | None = None
    logprobs: bool = False
    top_logprobs: ServedLogprobs | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM: extend the last (assistant) message
    echo: bool = False  # vLLM: the reply starts with the continued assistant message
    add_special_tokens: bool = False  # vLLM: the tokenizer's BOS on top of what the template adds
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM: extra variables for the template
    chat_template: str | None = None  # vLLM's: refused, as vLLM's default refuses it (compat.py)
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[FunctionDefinition] | None = None  # legacy: mapped onto tools
    function_call: FunctionCallChoice | None = None  # legacy tool_choice
    # Honoured where they mean something for a text model, refused otherwise (compat.py)
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None  # predicted output: a latency hint only
    reasoning_effort: ReasoningEffort | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


def _prompt_kind(value: Any) -> str | None:
    """The one member a prompt can be, by its first element. Tried in turn (pydantic's union), a
    list of 1.8 million token ids was first checked as strings, one error per id: 0.5 s holding
    the GIL (every stream waited) before the list of ints was even tried."""
    if isinstance(value, str):
        return "str"
    if not isinstance(value, list):
        return None
    first = value[0] if value else ""
    if isinstance(first, str):
        return "list[str]"
    return "list[list[int]]" if isinstance(first, list) else "list[int]"


# A completions prompt or embeddings input: text, texts, token ids, or lists of token ids (the tags
# are pydantic's own member names, so errors.field_path stops at the field, as before)
PromptInput = Annotated[
    Annotated[str, Tag("str")]
    | Annotated[list[str], Tag("list[str]")]
    | Annotated[list[int], Tag("list[int]")]
    | Annotated[list[list[int]], Tag("list[list[int]]")],
    Discriminator(
        _prompt_kind,
        custom_error_type="prompt_type",
        custom_error_message=(
            "Input should be a string, a list of strings, a list of token ids or a list of lists of token ids"
        ),
    ),
]


class CompletionRequest(SamplingFields):
    prompt: PromptInput  # ids are range-checked by the processor
    max_tokens: NonNegInt64 | None = None  # 0 with echo: the prompt scored alone (echo_only.py)
    logprobs: ServedLogprobs | None = None
    echo: bool = False
    suffix: str | None = None  # refused unless empty: no fill-in-the-middle (compat.py)
    add_special_tokens: bool = True  # vLLM: a text prompt gets the tokenizer's BOS

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_is_a_count(cls, value: Any) -> Any:
        """Chat's spelling, which clients send here too: `false` is no logprobs (it was a 400),
        `true` a 400 saying what this endpoint's logprobs is (not "a valid integer"; vLLM's lax
        parsing took it as 1, and false as 0: the sampled token's logprob, asked for or not)."""
        if value is False:
            return None
        if value is True:
            raise PydanticCustomError(
                "int_type",
                "on /v1/completions it is the number of top alternatives per token, an integer from 0 "
                f"to the server's --max-logprobs ({MAX_LOGPROBS} unless set; logprobs: true is chat "
                "completions' spelling, with top_logprobs)",
            )
        return value


class EmbeddingRequest(OpenAIBody):
    """OpenAI's embeddings body; `pooling` is kvserve's (vLLM sets it per model)."""

    model_config = ConfigDict(extra="forbid")
    null_means_default: ClassVar[frozenset[str]] = frozenset({"encoding_format"})
    model: str | None = None
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt64 | None = None  # only the model's own width (no Matryoshka truncation)
    user: str | None = None  # informational
    pooling: Literal["last", "mean"] = "last"
    priority: Int64 = 0
    truncate_prompt_tokens: Int64 | None = None  # vLLM: embed each input's last k tokens (-1: max_model_len)


class TokenizeRequest(OpenAIBody):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: list[ChatTool] | None = None  # counted as a chat request with these tools would be
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False  # vLLM: each id's token string too (token_strs)


class DetokenizeRequest(OpenAIBody):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
