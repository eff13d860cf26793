"""Whose fault a failed attempt is: the deployment's (counted towards its cooldown) or the
request's (not counted, or one request that no backend can answer would cool its whole group
for everyone else).

Connect errors, timeouts, 429, 401/403, 502-504 and broken answers are the deployment's, as in
LiteLLM, and count at once. A 500, or a stream whose first event is an error, is the backend
answering this request with an error: LiteLLM counts it too, but when the same request gets
such an answer from two or more deployments of a group (or one such answer and a 4xx from
another) the request is the likelier cause, and none of them counts. They count when another
attempt of the request succeeded in the group (they failed where it could be answered), or
when no second deployment answered it (nothing to tell them apart)."""

from __future__ import annotations

from kvserve.gateway.config import Deployment


class Blame:
    """One request's attempts within one group."""

    def __init__(self) -> None:
        self.held: list[Deployment] = []  # answered errors, counted or not when the group is done
        self.answered: set[str] = set()  # deployments whose backend answered the request at all

    def hold(self, dep: Deployment) -> None:
        self.held.append(dep)
        self.answered.add(dep.id)

    def answered_by(self, dep: Deployment) -> None:
        self.answered.add(dep.id)

    def to_count(self, succeeded: bool) -> list[Deployment]:
        """The held failures to count against their deployments, once (cleared)."""
        held, self.held = self.held, []
        return held if succeeded or len(self.answered) < 2 else []
