"""Budgets the state store does not hold (a Redis restarted without persistence or emptied, a
fresh one, a restarted gateway on the memory store) get their spend back from the spend log
before anything is admitted against them: a spend of 0 would let every key and team spend its
whole budget again. Rate-limit windows and cooldowns are not rebuilt (a minute's worth)."""

from __future__ import annotations

import asyncio
import logging

from kvserve.gateway.keys import KeyRecord
from kvserve.gateway.model_limits import owner_of
from kvserve.gateway.spend import SpendLog
from kvserve.gateway.state import Admission, Check, StateStore, StoreUnavailable
from kvserve.gateway.state.base import period_index, period_start

log = logging.getLogger("kvserve.gateway")


class BudgetRebuild:
    def __init__(self, store: StateStore, spend: SpendLog) -> None:
        self.store, self.spend = store, spend
        self._running: dict[str, asyncio.Future] = {}  # budget scope -> its rebuild

    async def admit(self, request_id: str, checks: list[Check], ttl: float, key: KeyRecord) -> Admission:
        """The store's admission, after seeding each budget it reports it does not hold."""
        for _ in range(len(checks) + 1):
            adm = await self.store.admit(request_id, checks, ttl)
            if adm.unseeded is None:
                return adm
            c = checks[adm.unseeded]
            task = self._running.get(c.scope)  # one rebuild a scope, however many requests wait
            if task is None:
                task = self._running[c.scope] = asyncio.ensure_future(self._seed(c, adm.now, key))
                task.add_done_callback(lambda _, scope=c.scope: self._running.pop(scope, None))
            await asyncio.shield(task)  # (a client leaving does not stop the others' rebuild)
        raise StoreUnavailable("state store: a budget stayed unseeded after seeding it")

    async def _seed(self, c: Check, now: float, key: KeyRecord) -> None:
        period = period_index(now, c.period)
        since = period_start(period, c.period)
        if c.scope.startswith("key:"):  # (a model_max_budget: that model's rows alone)
            spent = await self.spend.spent(since, key_hash=key.account, model=c.model)
        elif c.scope.startswith("user:"):
            user = owner_of(c).removeprefix("user:")
            spent = await self.spend.spent(since, user=user, model=c.model)
        else:
            team = owner_of(c).removeprefix("team:")
            spent = await self.spend.spent(since, team=team, model=c.model)
        if await self.store.seed_budget(c, period, spent) and spent > 0:
            who = f"key {key.name}" if c.scope.startswith("key:") else c.scope.replace(":", " ", 1)
            log.warning(
                "the state store did not hold the budget of %s (Redis restarted without persistence, "
                "or emptied): its spend this period, %.6g, was rebuilt from the spend log",
                who,
                spent,
            )
