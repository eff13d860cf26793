"""kvserve's routing policies as a Ray Serve request router (`request_router_config`).

Serve's handles pick a replica for every call through the deployment's RequestRouter; this
one asks a kvserve RoutingStrategy (cache-aware by default: kvserve/routing/cache_aware.py)
which replica should take the request, and ranks it first, the others after it. Serve then
sends to the first rank whose queue is below `max_ongoing_requests`, so a full favourite is
passed over rather than waited for. The strategy sees the same request the gateway does:
the prompt text (the router does not tokenize), the session (`x-session-id` or `user`) and
`cache_salt`; its load counts come from what this router sent (`started` when it decides,
`finished` when Serve reports the request completed). The router lives in each handle's
process (the front deployment's replicas); with several fronts each keeps its own view,
as N gateway instances do. A call with `pin` (a Responses follow-up: front.py) goes to that
replica only, which holds the conversation, while it runs. Imported by Serve from its class
path: imports Ray at the top.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvserve.routing import RequestInfo, RoutingStrategy, make_strategy
from kvserve.routing.request_text import prompt_text

MAX_TRACKED = 10_000  # decisions whose completion never came (cancelled before sending)


@dataclass
class _Target:
    id: str
    weight: float = 1.0


def request_info(args: list) -> RequestInfo:
    """From KVServeReplica.forward's (path, body, headers); anything else routes by load."""
    body = args[1] if len(args) > 1 and isinstance(args[1], dict) else {}
    headers = args[2] if len(args) > 2 and isinstance(args[2], dict) else {}
    salt = body.get("cache_salt")
    user = body.get("user")
    return RequestInfo(
        text=prompt_text(body),
        session=headers.get("x-session-id") or (user if isinstance(user, str) else None),
        cache_salt=salt if isinstance(salt, str) else None,
    )


class KVServeRequestRouter(RequestRouter):
    def initialize_state(self, policy: str = "cache-aware", **cache_aware: float) -> None:
        self.strategy: RoutingStrategy = make_strategy(policy, **cache_aware)
        # internal_request_id -> (replica unique id, request, when decided)
        self._decided: OrderedDict[str, tuple[str, RequestInfo, float]] = OrderedDict()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is None:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        key = pending_request.metadata.internal_request_id
        decided = self._decided.get(key)
        pin = pending_request.kwargs.get("pin")
        if decided is None or decided[0] not in by_id:  # first try, or its replica left
            if decided is not None:
                self._finish(key)
            info = request_info(list(pending_request.args))
            if pin in by_id:  # the replica holding the response (gone: another says so)
                chosen = pin
            else:
                chosen = self.strategy.choose([_Target(i) for i in sorted(by_id)], info).id
            self.strategy.started(chosen, info)
            decided = (chosen, info, time.monotonic())
            self._decided[key] = decided
            while len(self._decided) > MAX_TRACKED:
                self._finish(next(iter(self._decided)))
        first = by_id[decided[0]]
        if pin in by_id:  # no other replica can answer it
            return [[first]]
        rest = [r for r in candidate_replicas if r is not first]
        return [[first], rest] if rest else [[first]]

    def _finish(self, key: str) -> None:
        entry = self._decided.pop(key, None)
        if entry is not None:
            target, info, t0 = entry
            self.strategy.finished(target, time.monotonic() - t0, info)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._finish(internal_request_id)
