"""Which requests of an n-sample group compute their prompt, for the load a router and the
kvserve:num_waiting_prefill_tokens metric count.

The siblings of a group are forked from their leader's prefill (engine/sample_groups.py), so
they compute none of the prompt; counting the whole prompt for each made an n = 8 request
weigh eight prompts (a data-parallel router's balance guard tripped, an autoscaler saw 8x the
backlog). A sibling that cannot fork (its state is not shareable) or that arrives after its
leader has produced output computes the prompt itself and counts it.
"""

from __future__ import annotations

from collections.abc import Callable

from kvserve.sampling_params import SamplingParams


def forks(params: SamplingParams) -> bool:
    """Whether a sibling with these parameters is forked from its leader (sample_groups'
    `forkable`, decided on the API side)."""
    p = params
    shared_state = p.use_beam_search or p.structured_outputs is not None or p.prompt_logprobs is not None
    return not shared_state and p.pooling is None


class GroupLeaders:
    """Per engine: each live group's leader, the request whose prefill its siblings share."""

    def __init__(self) -> None:
        self._leader: dict[str, str] = {}  # group id -> request id

    def prompt_tokens(
        self,
        request_id: str,
        group_id: str | None,
        params: SamplingParams,
        num_tokens: int,
        waiting: Callable[[str], bool],
    ) -> int:
        """The prompt tokens `request_id` will compute: 0 for a sibling forked from a leader
        that is still `waiting` (queued or prefilling, no output yet); otherwise it leads its
        group from now on."""
        if group_id is None:
            return num_tokens
        leader = self._leader.get(group_id)
        if leader is not None and waiting(leader) and forks(params):
            return 0
        self._leader[group_id] = request_id
        return num_tokens

    def forget(self, request_id: str, group_id: str | None) -> None:
        if group_id is not None and self._leader.get(group_id) == request_id:
            del self._leader[group_id]

    def clear(self) -> None:
        self._leader.clear()
