"""Input processing: validate a prompt and its SamplingParams, tokenize, resolve limits.

Runs on the caller's side (offline LLM or API server) so a bad request is refused before
it reaches the engine core, with a ValueError that names the field.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvserve.engine.messages import EngineCoreRequest
from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.kv_transfer.params import check_kv_transfer_params
from kvserve.kv_transfer.peers import allowed
from kvserve.kv_transfer.refused import release_refused, same_lease
from kvserve.model.layers.bad_words import bad_words_token_ids
from kvserve.sampling_params import SamplingParams
from kvserve.structured.spec import check as check_grammar
from kvserve.tokenizer import Tokenizer


class ContextLengthError(ValueError):
    """A request longer than the model's context. The API reports it as OpenAI does (code
    context_length_exceeded, "this model's maximum context length is N tokens"), the words
    client libraries (LangChain, LiteLLM) look for to raise their context-overflow errors."""

    def __init__(self, field: str, max_model_len: int, why: str) -> None:
        super().__init__(f"{field}: this model's maximum context length is {max_model_len} tokens "
                         f"(max_model_len); {why}")  # fmt: skip


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against; comes from the engine core once it is loaded."""

    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int


class InputProcessor:
    def __init__(
        self, tokenizer: Tokenizer, limits: ModelLimits, kv_transfer: KVTransferConfig | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.kv_transfer = kv_transfer

    def _check_kv_transfer(self, params: SamplingParams) -> None:
        p = check_kv_transfer_params(params.kv_transfer_params)
        if p is None:
            return
        kt = self.kv_transfer
        if kt is None:
            raise ValueError("kv_transfer_params: this engine runs without --kv-transfer-config")
        if p.get("do_remote_decode") and not kt.is_producer:
            raise ValueError(
                f"kv_transfer_params: do_remote_decode needs a kv_producer engine, this is {kt.kv_role}"
            )
        if p.get("do_remote_prefill") and not kt.is_consumer:
            raise ValueError(
                f"kv_transfer_params: do_remote_prefill needs a kv_consumer engine, this is {kt.kv_role}"
            )
        host, port = p.get("remote_host"), p.get("remote_port")
        if p.get("do_remote_prefill") and host is not None:  # the connector would connect there
            if not allowed(kt.producer_peers, str(host), port):
                raise ValueError(
                    f"kv_transfer_params: remote_host: {host}:{port} is not a producer this engine pulls "
                    "from (kv_producers in its --kv-transfer-config)"
                )
        if params.use_beam_search:
            raise ValueError("kv_transfer_params: cannot be combined with use_beam_search")

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return self.tokenizer.encode(prompt)
        try:
            ids = list(prompt)
        except TypeError:  # a lone number or an object: was the TypeError "object is not iterable"
            raise ValueError(
                f"prompt: must be text or a list of token ids, got {type(prompt).__name__}"
            ) from None
        vocab = self.limits.vocab_size
        bad = ValueError(f"prompt: token ids must be integers in [0, {vocab})")
        # Plain ints are checked in C (min, max): a 1.8M-id prompt is checked in ~0.1 s while
        # the API process's streams wait on the GIL; isinstance against numbers.Integral for
        # every id took ~0.7 s. numpy integers count too, as plain ints from here on.
        if not all(type(t) is int for t in ids):
            if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in ids):
                raise bad
            ids = [int(t) for t in ids]
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise bad
        return ids

    def truncate(self, ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: max_model_len)."""
        if keep is None:
            return ids
        limit = self.limits.max_model_len
        if keep > limit:
            raise ValueError(f"truncate_prompt_tokens: must be at most max_model_len ({limit}), got {keep}")
        return ids[-(limit if keep == -1 else keep) :]

    def process(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        group_id: str | None = None,
    ) -> EngineCoreRequest:
        """The request for the core; ValueError naming the field that is wrong. A refused
        request that another engine prefilled for this one has that engine's lease released."""
        try:
            return self._process(request_id, prompt, params, arrival_time, priority, cache_salt, group_id)
        except ValueError:
            release_refused(self.kv_transfer, params.kv_transfer_params)
            raise

    def release_lease(self, params: SamplingParams, held: SamplingParams | None = None) -> None:
        """For a request refused outside `process` (its request id in use, a field that does
        not encode, the core down): release the lease another engine holds for it, unless
        `held`, the live request with that id, was given the same lease."""
        if held is None or not same_lease(params.kv_transfer_params, held.kv_transfer_params):
            release_refused(self.kv_transfer, params.kv_transfer_params)

    def _process(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        arrival_time: float | None,
        priority: int,
        cache_salt: str | None,
        group_id: str | None,
    ) -> EngineCoreRequest:
        lim = self.limits
        if -1 in (params.logprobs, params.prompt_logprobs):  # vLLM's -1: every token of the vocabulary
            params = replace(
                params,
                logprobs=lim.vocab_size if params.logprobs == -1 else params.logprobs,
                prompt_logprobs=lim.vocab_size if params.prompt_logprobs == -1 else params.prompt_logprobs,
            )
        ids = self.truncate(self.tokenize(prompt), params.truncate_prompt_tokens)
        n = len(ids)
        if n == 0:
            raise ValueError("prompt: must not be empty")
        # A prompt cut to fit (vLLM's truncate_prompt_tokens) generates as vLLM's does: up to the
        # context's end, one token after a whole context (its KV is never written).
        cap = max(lim.max_model_len - n, 1) if params.truncate_prompt_tokens and not params.pooling else None
        if params.pooling is not None:  # an embedding: no token is generated, so the whole context fits
            if n > lim.max_model_len:
                raise ContextLengthError("prompt", lim.max_model_len, f"the input has {n} tokens")
        elif n >= lim.max_model_len and cap is None:
            raise ContextLengthError(
                "prompt", lim.max_model_len, f"the prompt's {n} tokens leave no room to generate"
            )
        pool_tokens = lim.num_blocks * lim.block_size
        # Unset max_tokens: up to max_model_len, but never more than the whole KV pool holds.
        default = min(cap or lim.max_model_len - n, pool_tokens + 1 - n)
        max_tokens = params.max_tokens if params.max_tokens is not None else default
        max_tokens = max_tokens if cap is None else min(max_tokens, cap)
        if max_tokens < 1:
            raise ValueError(f"prompt: {n} tokens do not fit the KV pool ({pool_tokens} tokens)")
        if n + max_tokens > lim.max_model_len and params.pooling is None and cap is None:
            raise ContextLengthError(
                "max_tokens", lim.max_model_len,
                f"the prompt ({n} tokens) + max_tokens ({max_tokens}) exceed it",
            )  # fmt: skip
        need = -(-(n + max_tokens - 1) // lim.block_size)  # the last sampled token is never cached
        if need > lim.num_blocks:
            raise ValueError(
                f"max_tokens: prompt + max_tokens need {need} KV blocks but the pool has only "
                f"{lim.num_blocks}; lower max_tokens or raise kv_cache_memory"
            )
        if params.use_beam_search:
            # The prompt's full blocks are held once; each beam may need its own for the rest.
            per_beam = -(-(n % lim.block_size + max_tokens - 1) // lim.block_size)
            need = n // lim.block_size + params.n * per_beam
            if need > lim.num_blocks:
                # An unset max_tokens is not the client's: name the length it came to, not the field.
                length = f"max_tokens={max_tokens}"
                if params.max_tokens is None:
                    length = f"up to {max_tokens} tokens (max_tokens unset: the rest of the context)"
                raise ValueError(
                    f"n: {params.n} beams of {length} need up to {need} KV blocks but the pool has only "
                    f"{lim.num_blocks}"
                )
        elif params.n != 1:
            raise ValueError("n: the engine takes one sequence per request; callers fan n out")
        if params.top_k > lim.vocab_size:
            raise ValueError(f"top_k: must be -1, 0 or at most the vocabulary size ({lim.vocab_size})")
        if params.min_tokens > max_tokens:
            raise ValueError(f"min_tokens: must be <= max_tokens ({max_tokens}), got {params.min_tokens}")
        if params.seed is not None and not -(2**63) <= params.seed < 2**64:
            raise ValueError("seed: must fit a 64-bit integer")
        if not -(2**63) <= priority < 2**63:
            raise ValueError("priority: must fit a 64-bit signed integer")
        if params.logprobs is not None and params.logprobs > lim.vocab_size:
            raise ValueError(f"logprobs: at most the vocabulary size ({lim.vocab_size})")
        if params.prompt_logprobs is not None and params.prompt_logprobs > lim.vocab_size:
            raise ValueError(f"prompt_logprobs: at most the vocabulary size ({lim.vocab_size})")
        bad = [t for t in (params.logit_bias or {}) if not 0 <= int(t) < lim.vocab_size]
        if bad:
            raise ValueError(f"logit_bias: token ids out of range: {bad[:5]}")
        bad = [t for t in (params.stop_token_ids or []) if not 0 <= int(t) < lim.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: token ids out of range: {bad[:5]}")
        allowed = params.allowed_token_ids or []
        if allowed and (min(allowed) < 0 or max(allowed) >= lim.vocab_size):
            bad = [t for t in allowed if not 0 <= t < lim.vocab_size]
            raise ValueError(f"allowed_token_ids: token ids out of range [0, {lim.vocab_size}): {bad[:5]}")
        if params.bad_words and params.bad_words_token_ids is None:
            words = bad_words_token_ids(self.tokenizer, params.bad_words)
            params = replace(params, bad_words_token_ids=words)
        bad = [t for w in params.bad_words_token_ids or [] for t in w if not 0 <= t < lim.vocab_size]
        if bad:  # set directly (offline): an id past the vocabulary would fail the engine's step
            raise ValueError(f"bad_words: token ids out of range [0, {lim.vocab_size}): {bad[:5]}")
        if params.structured_outputs is not None:
            check_grammar(params.structured_outputs)  # an invalid schema never reaches the core
        self._check_kv_transfer(params)
        return EngineCoreRequest(
            request_id,
            ids,
            params,
            max_tokens,
            arrival_time or time.monotonic(),
            priority,
            cache_salt,
            group_id,
        )
