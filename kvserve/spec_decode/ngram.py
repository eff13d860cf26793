"""Prompt-lookup (n-gram) proposer: if the request's last n tokens appeared earlier in its
own prompt or output, propose the tokens that followed them there.

No model and no extra memory; it pays off when the output copies its input (editing a
passage, code, lists, extraction) and proposes nothing when there is no match.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kvserve.request import Request


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, items: list[tuple[Request, int]]) -> dict[str, list[int]]:
        return {req.request_id: self.lookup(req.all_token_ids, k) for req, k in items}

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens following the most recent earlier occurrence of the longest suffix
        n-gram (max_n down to min_n); empty when none matches."""
        arr = np.asarray(tokens, dtype=np.int64)
        total = len(arr)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            # Windows that start early enough to have at least one token after them.
            windows = sliding_window_view(arr[: total - 1], n)
            hits = np.flatnonzero((windows == arr[total - n :]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return arr[start : start + k].tolist()
        return []
