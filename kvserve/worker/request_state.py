"""The workers' mirror of the requests they run, kept current by each step's deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.worker.step_input import StepInput


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    prompt_logprobs: int | None
    all_token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    pooling: str | None = None
    pool_sum: torch.Tensor | None = None  # mean pooling: the prompt rows' sum so far

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class RequestStates(dict[str, CachedRequestState]):
    def apply(self, step: StepInput) -> list[tuple[CachedRequestState, int]]:
        """Bring the mirror up to this step; returns (state, tokens to compute) in batch order."""
        for rid in step.finished_req_ids:
            self.pop(rid, None)
        for new in step.new_requests:
            self[new.req_id] = CachedRequestState(
                new.req_id, new.prompt_token_ids, new.prompt_logprobs, list(new.prompt_token_ids),
                pooling=new.pooling,
            )  # fmt: skip
        batch = []
        for s in step.scheduled:
            st = self[s.req_id]
            st.all_token_ids.extend(s.new_token_ids)
            if s.resumed:
                st.block_ids = list(s.new_block_ids)
            else:
                st.block_ids.extend(s.new_block_ids)
            st.num_computed_tokens = s.num_computed_tokens
            st.spec_token_ids = s.spec_token_ids
            batch.append((st, s.num_new_tokens))
        return batch
