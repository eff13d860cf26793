"""Per-request generation settings, validated on construction."""

from __future__ import annotations

import copy
import functools
import json as _json
import math
import numbers
from dataclasses import dataclass

from kvserve.sampling_params_compat import VLLM_ONLY, check_vllm_only

# Beam search divides by generated_length ** length_penalty: past this a long beam's power
# leaves the float range (2 ** 1024 already does); transformers' usual values are 0.5-2.
MAX_LENGTH_PENALTY = 20


# A choice list compiles to one alternation, and xgrammar's compile grows much faster than it
# (default model, 49k vocabulary, ~16-character strings: 5,000 0.1 s, 10,000 7.5 s, 20,000 24 s,
# holding the large-spec lane): capped as a schema's enum values are (structured/spec.py).
MAX_CHOICES = 10_000
MAX_CHOICE_CHARS = 250_000


@dataclass
class StructuredOutputsParams:
    """Constrain the output to exactly one of these (compiled with xgrammar in the engine)."""

    json: str | dict | bool | None = None
    """A JSON schema (a dict or bool is serialized; property order is kept, it is the output order)."""
    json_object: bool = False
    """Any JSON object."""
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    """EBNF / GBNF, with a `root` rule."""

    def __post_init__(self) -> None:
        if isinstance(self.json, (dict, bool)):  # true / false are schemas too (any value / none)
            self.json = _json.dumps(self.json)
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None] + (
            ["json_object"] if self.json_object else []
        )
        _check(
            len(given) == 1,
            "structured_outputs",
            f"give exactly one of json, json_object, regex, choice, grammar (got {given or 'none'})",
        )
        if self.choice is not None:
            _check(
                bool(self.choice) and all(isinstance(c, str) for c in self.choice),
                "structured_outputs",
                "choice must be a non-empty list of strings",
            )
            chars = sum(len(c) for c in self.choice)
            _check(
                len(self.choice) <= MAX_CHOICES and chars <= MAX_CHOICE_CHARS,
                "structured_outputs",
                f"choice holds {len(self.choice):,} {'string' if len(self.choice) == 1 else 'strings'}, "
                f"{chars:,} characters in all (at most "
                f"{MAX_CHOICES:,} strings and {MAX_CHOICE_CHARS:,} characters: compiling more takes "
                "minutes); use a regex, or fewer choices",
            )
            for i, c in enumerate(self.choice):  # "" is allowed, as vLLM has it: the empty answer
                lone = next((ch for ch in c if "\ud800" <= ch <= "\udfff"), None)
                _check(
                    lone is None,
                    "structured_outputs",
                    f"choice[{i}] holds a lone surrogate (U+{ord(lone or 'x'):04X}), which is no text "
                    "an answer could hold",
                )


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1) disables top-k."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    """None: up to max_model_len."""
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    """Return the chosen token's logprob and this many top alternatives (-1: the whole vocabulary)."""
    prompt_logprobs: int | None = None
    """Return logprobs of every prompt token (and this many alternatives; -1: the whole vocabulary)."""
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    """Constrained decoding: the output matches this schema / regex / choice / grammar."""
    pooling: str | None = None
    """Embedding instead of generation: "last" or "mean" of the prompt's final hidden states;
    the request ends when its prompt is computed (no token is sampled)."""
    use_beam_search: bool = False
    """Beam search with n beams, returning the n best sequences (transformers' num_beams=n,
    num_return_sequences=n); deterministic, so temperature / top-p / top-k / seed do not apply."""
    length_penalty: float = 1.0
    """Beam search: a finished sequence scores sum(logprobs) / generated_length ** length_penalty."""
    early_stopping: bool | str = False
    """Beam search: True, False or "never", as transformers (docs/BEAM_SEARCH.md)."""
    truncate_prompt_tokens: int | None = None
    """Keep only the prompt's last k tokens (left truncation), as vLLM's; -1: the last
    max_model_len tokens. A cut prompt generates up to the context's end, as vLLM's LLM (one
    token after a whole context)."""
    allowed_token_ids: list[int] | None = None
    """Sample only these tokens (vLLM's): every other token's logit is -inf."""
    bad_words: list[str] | None = None
    """Never generate these words, as vLLM: a word's last token is banned wherever the output so
    far ends with its other tokens (each word tokenized alone and after a space)."""
    bad_words_token_ids: list[list[int]] | None = None
    """bad_words as token sequences: filled by the input processor, which has the tokenizer."""
    kv_transfer_params: dict | None = None
    """Prefill/decode disaggregation (kvserve/kv_transfer/params.py): keep this prompt's KV for
    a decode engine, or take it from the prefill engine named here."""

    def __post_init__(self) -> None:
        # Not a dataclass field, so it is not serialized; rebuilt wherever params are made.
        self.stop_list = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.structured_outputs = _constraint(self.structured_outputs)
        self._check_types()
        if self.top_k == -1:
            self.top_k = 0
        _check(self.n >= 1, "n", f"must be >= 1, got {self.n}")
        _check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be -1, 0 or positive, got {self.top_k}")
        _check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            self.repetition_penalty > 0, "repetition_penalty", f"must be > 0, got {self.repetition_penalty}"
        )
        _check(
            -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            f"must be >= 1, got {self.max_tokens}",
        )
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
        )
        # -1, as vLLM's: every token of the vocabulary (the engine's processor resolves it)
        _check(
            self.logprobs is None or self.logprobs >= -1,
            "logprobs",
            f"must be -1 or >= 0, got {self.logprobs}",
        )
        _check(
            self.prompt_logprobs is None or self.prompt_logprobs >= -1,
            "prompt_logprobs",
            f"must be -1 or >= 0, got {self.prompt_logprobs}",
        )
        _check(
            self.truncate_prompt_tokens is None
            or self.truncate_prompt_tokens == -1
            or self.truncate_prompt_tokens >= 1,
            "truncate_prompt_tokens",
            f"must be -1 or >= 1, got {self.truncate_prompt_tokens}",
        )
        _check(all(isinstance(s, str) and s for s in self.stop_list), "stop", "must be non-empty strings")
        _check(
            self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
            "allowed_token_ids",
            "must not be empty (no token could be sampled); leave it unset to allow all",
        )
        _check(
            all(isinstance(w, str) and w.strip() for w in self.bad_words or ()),
            "bad_words",
            "must be a list of non-blank strings",
        )
        _check(
            self.pooling in (None, "last", "mean"), "pooling", f"must be last or mean, got {self.pooling!r}"
        )
        # n embeddings of one prompt are one embedding computed n times (and n empty completions)
        _check(self.pooling is None or self.n == 1, "n", f"must be 1 with pooling (got {self.n})")
        if self.use_beam_search:
            self._check_beam_search()

    def _check_types(self) -> None:
        """Counts and token ids are integers and weights finite numbers: a float top_k or a
        string logit_bias key would otherwise fail inside the engine's step (an "engine failed"
        error), and an infinite temperature or a NaN bias silently sample garbage. Each is kept
        as Python's int or float: numpy's (seed=np.int64(3)) overflowed int64 arithmetic in the
        n samples' seeds (an OverflowError from generate) and does not encode for the core."""
        for name in ("n", "top_k", "min_tokens", "max_tokens", "seed", "logprobs", "prompt_logprobs",
                     "truncate_prompt_tokens"):  # fmt: skip
            value = getattr(self, name)
            _check(value is None or _is_int(value), name, f"must be an integer, got {value!r}")
            setattr(self, name, None if value is None else int(value))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "length_penalty"):  # fmt: skip
            value = getattr(self, name)
            _check(_is_finite(value), name, f"must be a finite number, got {value!r}")
            setattr(self, name, float(value))
        for tok, bias in (self.logit_bias or {}).items():
            _check(_is_int(tok), "logit_bias", f"keys must be integer token ids, got {tok!r}")
            _check(_is_finite(bias), "logit_bias", f"values must be finite numbers, got {bias!r}")
        for name in ("allowed_token_ids", "bad_words", "bad_words_token_ids"):
            value = getattr(self, name)
            _check(value is None or isinstance(value, list | tuple), name, f"must be a list, got {value!r}")
        for name in ("stop_token_ids", "allowed_token_ids"):
            for tok in getattr(self, name) or ():
                _check(_is_int(tok), name, f"must be integer token ids, got {tok!r}")
        for word in self.bad_words_token_ids or ():
            _check(
                isinstance(word, list | tuple) and bool(word) and all(_is_int(t) for t in word),
                "bad_words", "token ids must be non-empty lists of integers",
            )  # fmt: skip
        if self.logit_bias:
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        if self.stop_token_ids:
            self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]

    def _check_beam_search(self) -> None:
        """What beam search cannot honour is refused, naming the field."""
        _check(
            self.early_stopping in (True, False, "never"), "early_stopping", "must be true, false or never"
        )
        _check(  # a finite but large one overflowed `length ** length_penalty` and ended the engine core
            abs(self.length_penalty) <= MAX_LENGTH_PENALTY,
            "length_penalty",
            f"must be within [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}], got {self.length_penalty!r}",
        )
        unsupported = {
            "logprobs": self.logprobs is not None,
            "prompt_logprobs": self.prompt_logprobs is not None,
            "stop": bool(self.stop_list),
            "structured_outputs": self.structured_outputs is not None,
            "logit_bias": bool(self.logit_bias),
            "allowed_token_ids": self.allowed_token_ids is not None,
            "bad_words": bool(self.bad_words or self.bad_words_token_ids),
            "pooling": self.pooling is not None,
            "repetition_penalty": self.has_penalties,
        }
        for name, given in unsupported.items():
            _check(not given, name, "is not supported with use_beam_search")

    def clone(self) -> SamplingParams:
        """A deep copy, as vLLM's (scripts clone a default and edit the copy)."""
        return copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def masks_tokens(self) -> bool:
        """Whether allowed_token_ids or bad_words take tokens out of the logits."""
        return self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class BeamSearchParams:
    """vLLM's `LLM.beam_search` parameters, run as SamplingParams(n=beam_width,
    use_beam_search=True): transformers' beam arithmetic (docs/BEAM_SEARCH.md)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    """0 only: the search is deterministic (vLLM's takes it; transformers' beams do not sample)."""
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    """Keep the end-of-sequence token that ended a beam in its tokens and text."""

    def __post_init__(self) -> None:
        _check(
            _is_int(self.beam_width) and self.beam_width >= 1,
            "beam_width",
            f"must be >= 1, got {self.beam_width!r}",
        )
        _check(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            "max_tokens",
            f"must be >= 1, got {self.max_tokens!r}",
        )
        _check(
            self.temperature == 0,
            "temperature",
            f"must be 0: beam search does not sample, got {self.temperature!r}",
        )

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            n=self.beam_width, use_beam_search=True, temperature=0, max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos, length_penalty=self.length_penalty,
        )  # fmt: skip


def _vllm_fields_checked(init):
    """SamplingParams' dataclass __init__, with vLLM's fields it lacks checked first."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs) -> None:
        if not VLLM_ONLY.keys().isdisjoint(kwargs):
            check_vllm_only(kwargs)
        init(self, *args, **kwargs)

    return __init__


SamplingParams.__init__ = _vllm_fields_checked(SamplingParams.__init__)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_finite(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _constraint(given: object) -> StructuredOutputsParams | None:
    """structured_outputs as StructuredOutputsParams: a dict of its fields ({"json": schema}, the
    server's body shape) is taken as one; it and any other type failed inside generate with
    "'dict' object has no attribute 'json'"."""
    if given is None or isinstance(given, StructuredOutputsParams):
        return given
    if not isinstance(given, dict):
        raise ValueError(f"structured_outputs: expected StructuredOutputsParams, got {type(given).__name__}")
    try:
        return StructuredOutputsParams(**given)
    except TypeError:
        known = ", ".join(StructuredOutputsParams.__dataclass_fields__)
        unknown = sorted(set(given) - set(StructuredOutputsParams.__dataclass_fields__))
        raise ValueError(f"structured_outputs: unknown key(s) {unknown} (known: {known})") from None


def _check(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {why}")
