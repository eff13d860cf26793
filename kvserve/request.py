"""The engine's record of one request: its tokens, progress, state and timings."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from kvserve.structured.state import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # its prompt's blocks are on the way (kv_transfer/)
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # failed inside the engine (see EngineCore._recover_failed_step)

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


BACKGROUND_PRIORITY = 2**63 - 1
"""The lowest priority there is (batch jobs): scheduled after every other request, preempted
first, under both scheduling policies."""


class RemoteKV:
    """A consumer's load of a request's prompt KV: `local_tokens` came from this engine's
    prefix cache, `remote_tokens` after them from the producer; `loaded` once written."""

    __slots__ = ("local_tokens", "remote_tokens", "loaded")

    def __init__(self, local_tokens: int, remote_tokens: int) -> None:
        self.local_tokens, self.remote_tokens, self.loaded = local_tokens, remote_tokens, False


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos_token_ids: frozenset[int],
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        group_id: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.max_tokens = max_tokens
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.stop_token_ids = frozenset(params.stop_token_ids or ())
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.priority = priority  # lower runs sooner under the "priority" policy
        self.cache_salt = cache_salt  # separates prefix-cache namespaces
        self.group_id = group_id  # the n samples of one request share this (and their prompt's blocks)
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at admission
        self.followers: list[Request] = []  # n > 1: siblings that fork once this one's prompt is done
        self.spec_token_ids: list[int] = []  # proposed tokens to verify in the next step
        self.spec_state = None  # kvserve.spec_decode.adaptive.SpecState when speculating
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            import torch  # here: the API process imports this module for its constants only

            self.generator = torch.Generator().manual_seed(params.seed)
        self.grammar: GrammarState | None = None  # structured outputs: set once compiled
        self.remote_kv: RemoteKV | None = None  # prefill/decode disaggregation: the load, once tried
        self.kv_transfer_out: dict | None = None  # a producer's kv_transfer_params for the response
        self.logprobs: list[dict[int, float]] = []
        self.logprob_ranks: list[int | None] = []  # the sampled tokens' ranks, as logprobs
        self.prompt_logprobs: list[dict[int, float] | None] = (
            [None] if params.prompt_logprobs is not None else []
        )
        # Each prompt token's rank in the vocabulary, as prompt_logprobs (None for the first).
        self.prompt_logprob_ranks: list[int | None] = [None] if params.prompt_logprobs is not None else []
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def background(self) -> bool:
        return self.priority == BACKGROUND_PRIORITY

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def fork(self, request_id: str) -> Request:
        """A copy with the same tokens and progress under a new id (a beam-search fork). Its
        KV blocks come from KVCacheManager.fork; beams carry no generator, grammar or logprobs."""
        child = Request(
            request_id, self.prompt_token_ids, self.params, self.max_tokens, self.eos_token_ids,
            self.arrival_time, self.priority, self.cache_salt, self.group_id,
        )  # fmt: skip
        child.all_token_ids = list(self.all_token_ids)
        child.output_token_ids = list(self.output_token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        child.num_cached_tokens = self.num_cached_tokens
        child.first_scheduled_time = self.first_scheduled_time
        child.first_token_time = self.first_token_time
        return child

    @property
    def stopped_on_token(self) -> bool:
        """Ended by its last token, an EOS or a stop token id (not a finished grammar or a length)."""
        last = self.output_token_ids[-1] if self.output_token_ids else None
        return self.status is RequestStatus.FINISHED_STOPPED and (
            last in self.eos_token_ids or last in self.stop_token_ids
        )

    def check_stop(self, max_model_len: int) -> bool:
        """Set a finished status if the last token ends the request (EOS, stop id, a finished
        grammar, length)."""
        n = len(self.output_token_ids)
        last = self.output_token_ids[-1]
        if n >= self.params.min_tokens and (last in self.eos_token_ids or last in self.stop_token_ids):
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = last if last in self.stop_token_ids else None
        elif self.grammar is not None and self.grammar.is_terminated():
            self.status = RequestStatus.FINISHED_STOPPED
        elif n >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
        return self.status.finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, {self.num_computed_tokens}/{self.num_tokens})"
        )
