"""Model groups, cooldowns and the choice of a deployment for the next attempt."""

from __future__ import annotations

import logging

from kvserve.gateway.config import Deployment, GatewayConfig
from kvserve.gateway.state import StateStore
from kvserve.routing import RequestInfo, RoutingStrategy, make_strategy
from kvserve.routing.request_text import prompt_text

log = logging.getLogger("kvserve.gateway")


def request_info(body: dict, headers) -> RequestInfo:
    """What request-aware strategies see of a body: its prompt text (the gateway does not
    tokenize; cache-aware matches text), the session (`x-session-id` header or `user`)."""
    user = body.get("user") if isinstance(body.get("user"), str) else None
    salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
    return RequestInfo(text=prompt_text(body), session=headers.get("x-session-id") or user, cache_salt=salt)


class _Target:
    """A deployment as the routing strategy sees it."""

    __slots__ = ("dep", "id", "weight")

    def __init__(self, dep: Deployment) -> None:
        self.dep, self.id, self.weight = dep, dep.id, dep.backend.weight


class Router:
    def __init__(
        self, cfg: GatewayConfig, store: StateStore, strategy: RoutingStrategy | None = None
    ) -> None:
        self.cfg, self.store = cfg, store
        self.rs = cfg.router_settings
        thresholds = {}
        if self.rs.routing_strategy == "cache-aware":
            thresholds = dict(
                balance_abs_threshold=self.rs.balance_abs_threshold,
                balance_rel_threshold=self.rs.balance_rel_threshold,
            )
        self.strategy = strategy or make_strategy(self.rs.routing_strategy, **thresholds)
        self.groups: dict[str, list[_Target]] = {}
        for d in cfg.model_list:
            self.groups.setdefault(d.model_name, []).append(_Target(d))
        self.by_id = {d.id: d for d in cfg.model_list}

    def deployments(self, alias: str) -> list[Deployment]:
        return [t.dep for t in self.groups.get(alias, [])]

    async def pick(
        self, alias: str, excluded: set[str], tried: set[str], request: RequestInfo | None = None
    ) -> Deployment | None:
        """A deployment of the group that is not cooling down and not excluded, preferring one not
        yet tried for this request; None when the group has nothing left."""
        targets = [t for t in self.groups[alias] if t.id not in excluded]
        if not targets:
            return None
        cooling = await self.store.cooling([t.id for t in targets])
        live = [t for t in targets if t.id not in cooling]
        if not live:
            return None
        fresh = [t for t in live if t.id not in tried]
        return self.strategy.choose(fresh or live, request).dep

    async def failed(self, dep: Deployment) -> bool:
        """Count a failure; True when the deployment went into cooldown because of it.

        A group's only deployment is never cooled (LiteLLM's rule too): cooling it would answer
        every request of the group 503 for `cooldown_time`, however soon the backend recovers,
        and a few bodies that make it fail were enough to start that. Its requests keep trying
        it, and its fallbacks take over each one that fails."""
        if len(self.groups.get(dep.model_name, ())) < 2:
            return False
        cooled = await self.store.record_failure(dep.id, self.rs.allowed_fails, self.rs.cooldown_time)
        if cooled:
            log.warning("deployment %s cooling down for %.0f s", dep.id, self.rs.cooldown_time)
        return cooled
