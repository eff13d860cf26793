"""What the engine sends every rank each step, and what rank 0 sends back.

`StepInput` is serializable (msgspec) and holds no live scheduler objects: a request travels
whole once, when the workers first see it (`NewRequestData`), and afterwards as a delta
(`ScheduledRequest`: tokens appended since, blocks added since, where its computation
starts). The workers keep their own mirror of each request (worker/request_state.py).

The workers do not sample, as a rule: sampling needs the grammar matchers, per-request
generators and penalty history, which live with the scheduler in the engine process, so rank 0
returns the logits of the rows that produce a token (`RunnerOutput`) and the engine samples
them. The exception is sampling on the device (on CUDA by default): rows that need none of
that state are listed in `DeviceSampling`, with the grammar bitmasks the engine filled, and
rank 0 samples them where the logits are and returns only their token ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import torch


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    req_id: str
    prompt_token_ids: list[int]
    prompt_logprobs: int | None = None  # top-k of prompt logprobs, when asked for
    pooling: str | None = None  # "last" | "mean": an embedding request (no token is sampled)


class ScheduledRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's share of this step, as a delta against what the workers already know."""

    req_id: str
    num_new_tokens: int  # tokens computed this step, proposals included
    num_computed_tokens: int  # where they start
    new_token_ids: list[int] = []  # appended since the workers last saw the request
    new_block_ids: list[int] = []  # blocks added since (the whole table when `resumed`)
    resumed: bool = False  # new_block_ids replace the table (back from preemption, or copy-on-write)
    spec_token_ids: list[int] = []  # proposals to verify this step


class DeviceSampling(msgspec.Struct, array_like=True, omit_defaults=True):
    """Requests whose token this step is sampled on the device (model/layers/device_sampler.py),
    one entry per request; a listed request that produces no token this step is ignored."""

    req_ids: list[str] = []
    temperature: list[float] = []  # 0.0: greedy
    top_k: list[int] = []  # 0: off
    top_p: list[float] = []  # 1.0: off
    grammar_rows: list[int] = []  # indices into req_ids of the constrained requests
    bitmask: bytes = b""  # their bitmasks: int32 [len(grammar_rows), words], xgrammar's layout


class StepInput(msgspec.Struct, array_like=True, omit_defaults=True):
    new_requests: list[NewRequestData] = []
    scheduled: list[ScheduledRequest] = []  # in batch order
    finished_req_ids: list[str] = []  # forget these before running the step
    block_copies: list[tuple[int, int]] = []  # (src, dst): copy-on-write, done before the forward
    device_sampling: DeviceSampling | None = None  # None: every row's logits go to the engine


@dataclass
class RunnerOutput:
    """Logits rows in order: one per `sample_req_ids`, then len(drafts) + 1 per `verify`;
    the requests sampled on the device are in `sampled` instead (no logits row)."""

    sample_req_ids: list[str] = field(default_factory=list)
    verify: list[tuple[str, int]] = field(default_factory=list)  # (req_id, number of drafts)
    logits: torch.Tensor | None = None  # float32 [rows, vocab] on CPU
    prompt_logprobs: dict[str, list[dict[int, float] | None]] = field(default_factory=dict)
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)  # embedding requests whose prompt is done
    sampled: dict[str, int] = field(default_factory=dict)  # token ids sampled on the device
    # As prompt_logprobs: each prompt token's rank in the vocabulary.
    prompt_logprob_ranks: dict[str, list[int]] = field(default_factory=dict)
