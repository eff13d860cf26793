"""Per-request speculation control: propose as far as recent acceptance justifies, and back
off from requests whose drafts keep failing.

Verifying k drafts costs a wider forward pass; if they are rarely accepted the request pays
that cost for nothing. Each request keeps a moving average of its accepted-run length. The
next proposal is at most that average plus one (so k shrinks when runs are short) and, when
the acceptance rate falls below `min_rate`, speculation pauses for a number of steps that
doubles each time it fails again (and resets after a good draft).
"""

from __future__ import annotations


class SpecState:
    ALPHA = 0.5  # weight of the newest draft in the moving averages
    MIN_RATE = 0.25  # below this acceptance rate, pause
    FIRST_PAUSE = 4
    MAX_PAUSE = 64

    def __init__(self, k: int) -> None:
        self.k = k
        self.avg_accepted = float(k)  # optimistic start: the first drafts are full length
        self.avg_rate = 1.0
        self.pause = 0  # steps left without speculation
        self.next_pause = self.FIRST_PAUSE

    def num_to_propose(self) -> int:
        """How many tokens to propose this step (0: do not speculate)."""
        if self.pause > 0:
            self.pause -= 1
            return 0
        return max(1, min(self.k, int(self.avg_accepted + 1.5)))

    def record(self, num_draft: int, num_accepted: int) -> None:
        a = self.ALPHA
        self.avg_accepted = (1 - a) * self.avg_accepted + a * num_accepted
        self.avg_rate = (1 - a) * self.avg_rate + a * (num_accepted / num_draft)
        if self.avg_rate < self.MIN_RATE:
            self.pause = self.next_pause
            self.next_pause = min(self.next_pause * 2, self.MAX_PAUSE)
            self.avg_rate = self.MIN_RATE * 2  # give it a fair chance after the pause
            self.avg_accepted = 1.0
        elif num_accepted == num_draft:
            self.next_pause = self.FIRST_PAUSE
