"""What the engine hands back: per-request outputs with text, tokens and timings."""

from __future__ import annotations

from dataclasses import dataclass, field


class Logprob(float):
    """One token's logprob as vLLM's `Logprob` (`.logprob`, `.rank`, `.decoded_token`), and still
    the float it was before, so both `lp[tok].logprob` and `lp[tok] + x` read it. The offline
    `LLM` returns these; the engine and the server keep plain floats (msgspec encodes no float
    subclass). `rank` is 1-based among the whole vocabulary: the sampled or prompt token's always
    (the engine counts it), an alternative's within the top ones asked for."""

    logprob: float
    rank: int | None
    decoded_token: str | None

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        self = super().__new__(cls, logprob)
        self.logprob, self.rank, self.decoded_token = float(logprob), rank, decoded_token
        return self

    def __repr__(self) -> str:
        return f"Logprob(logprob={self.logprob!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"

    def __reduce__(self):  # pickled with its fields, not as a bare float
        return (Logprob, (self.logprob, self.rank, self.decoded_token))


@dataclass
class RequestMetrics:
    """Monotonic timestamps (time.monotonic) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    background: bool = False  # a batch line: kept out of the interactive latency histograms

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def decode_time(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None:
            return None
        return self.finished_time - self.first_token_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """'stop', 'length', 'abort' or 'error' once finished."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the request, if any (with 'error': the
    engine's message)."""
    logprobs: list[dict[int, float]] | None = None
    """Per sampled token: it and the top alternatives asked for; the offline `LLM`'s values are
    `Logprob`s (vLLM's shape), the engine's plain floats."""
    logprob_ranks: list[int | None] | None = None
    """Per sampled token (as `logprobs`): its rank in the whole vocabulary, 1 + the tokens with a
    higher logprob, which the top-k entry cannot tell for a token outside it (vLLM's
    `Logprob.rank` of the sampled token)."""
    delta_text: str = ""
    """Text released since the previous output of this request (for streaming)."""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict[int, float]] | None = None
    """Logprobs of delta_token_ids only (a snapshot; `logprobs` keeps growing while streaming)."""
    text_token_ids: list[int] = field(default_factory=list)
    """The tokens whose text delta_text released (what a stream shows with it): a token held
    back as a possible stop string's start waits, and one a stop string cut is never here."""
    text_logprobs: list[dict[int, float]] | None = None
    """Logprobs of text_token_ids."""
    cumulative_logprob: float | None = None
    """The sum of the sampled tokens' logprobs (of token_ids), as vLLM's; None unless
    SamplingParams.logprobs is set (the logprobs are not computed otherwise)."""

    def finished(self) -> bool:
        """As vLLM's: whether this sequence has ended."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """None for the first prompt token; values as CompletionOutput.logprobs'."""
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""
    embedding: list[float] | None = None
    """Embedding requests (SamplingParams.pooling): the pooled final hidden state."""
    kv_transfer_params: dict | None = None
    """A prefill engine's answer to do_remote_decode: where a decode engine finds the KV."""
    prompt_logprob_ranks: list[int | None] | None = None
    """As prompt_logprobs: each prompt token's rank in the whole vocabulary, 1 + the tokens with
    a higher logprob (vLLM's `Logprob.rank`), which the top-k entry cannot tell for a token
    outside it."""


@dataclass
class EmbeddingOutput:
    embedding: list[float]
    """L2-normalized, as the server's /v1/embeddings and vLLM's LLM.embed return it."""


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt, shaped as vLLM's (`out.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class PoolingOutput:
    data: object
    """The pooled vector as a torch tensor (vLLM's `outputs.data`): for the "embed" task, the
    L2-normalized embedding LLM.embed returns."""


@dataclass
class PoolingRequestOutput:
    """What `LLM.encode` returns per prompt, shaped as vLLM's (`out.outputs.data`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True


@dataclass
class BeamSearchSequence:
    """One of `LLM.beam_search`'s best sequences, as vLLM's: `tokens` and `text` hold the prompt
    too; `logprobs` is empty (beam search returns none per token), `cum_logprob` their sum."""

    tokens: list[int]
    logprobs: list[dict[int, float]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """What `LLM.beam_search` returns per prompt: the best sequences, best first."""

    sequences: list[BeamSearchSequence]
