"""What crosses between the API side and the engine core: compact msgspec structs.

The same structs are used in-process by the offline engine, so both paths share one
protocol; across processes they are msgpack-encoded, one message per step's outputs.
"""

from __future__ import annotations

import msgspec

from kvserve.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against max_model_len by the input processor
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    group_id: str | None = None  # shared by the n samples of one API request


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request's progress in one step: its new tokens and, once, how it ended."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # with "error": what went wrong
    new_logprobs: list[dict[int, float]] | None = None
    new_logprob_ranks: list[int | None] | None = None  # the new tokens' ranks in the vocabulary
    prompt_logprobs: list[dict[int, float] | None] | None = None  # sent with the first token
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # sent with the first token
    embedding: list[float] | None = None  # pooling requests: the vector, sent as they finish
    kv_transfer_params: dict | None = None  # a producer's answer: where a decode engine finds the KV
    cumulative_logprob: float | None = None  # a beam search result's summed logprobs (no per-token ones)
    stopped_on_token: bool = False  # ended by its last token (EOS or a stop token id): its text is left out
    prompt_logprob_ranks: list[int | None] | None = None  # as prompt_logprobs: each prompt token's rank
    refused: bool = False  # with "error": the request's own parameters ended it (a 400, not a 500)


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    outputs: list[EngineCoreOutput]
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    # of those, the background tier's (batch lines): outside saturation and interactive gauges
    num_running_background: int = 0
    num_waiting_background: int = 0
    kv_cache_usage_background: float = 0.0
    num_preemptions_total: int = 0
    iteration_tokens: int = 0
    prefix_cache_queries: int = 0  # running totals, in tokens
    prefix_cache_hits: int = 0
    spec_num_drafts: int = 0  # speculative decoding running totals
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []
    # Prefix-cache changes since the last message (only from a core asked to publish them):
    kv_stored: list[bytes] = []
    kv_removed: list[bytes] = []
    kv_cleared: bool = False
    # Prefill/decode disaggregation running totals (a consumer's fetches; a producer's leases):
    kv_transfers: int = 0
    kv_transfer_failures: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    kv_leases_expired: int = 0
