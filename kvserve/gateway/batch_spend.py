"""A Batch API batch's tokens charged to the key (and team) that created it, as LiteLLM's proxy
charges them: the batch's `usage` at the deployment's batch prices, once, when the gateway first
sees the batch finished (any retrieve or list of it, by any instance: a claim in the state store
makes it once). A batch runs on the backend, outside the per-request admission, so a budget is
checked when the batch is created (refused only when already spent) and may be overrun by that
batch: the charge comes after the work, as LiteLLM's does.

The finished batch's output and error files join the owner's file list then too, as OpenAI's
`files.list` shows a batch's `batch_output` files beside the uploads."""

from __future__ import annotations

import logging
import math
import time
import uuid

from kvserve.gateway.budget_words import exceeded
from kvserve.gateway.config import Backend, Deployment
from kvserve.gateway.errors import GatewayError, limit_reached
from kvserve.gateway.handler import Gateway
from kvserve.gateway.keys import KeyRecord, KeyStore
from kvserve.gateway.limits import tenant_checks
from kvserve.gateway.model_limits import owner_model_checks
from kvserve.gateway.spend import SpendRow
from kvserve.gateway.state import Check, StoreUnavailable
from kvserve.gateway.state.base import EPS

log = logging.getLogger("kvserve.gateway")
FINISHED = frozenset({"completed", "failed", "cancelled", "expired"})
TTL = 30 * 86400.0  # as the key's lists of ids (batches.py)
_OUTPUT_FILES = ("output_file_id", "error_file_id")


def batch_cost(backend: Backend, usage: object) -> tuple[int, int, float] | None:
    """(input tokens, output tokens, cost) of a Batch object's `usage` (OpenAI's), at the batch
    prices when the deployment has them; None when the backend reported none."""
    if not isinstance(usage, dict):
        return None
    tokens = [usage.get(k) for k in ("input_tokens", "output_tokens")]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        return None
    i, o = tokens
    pi, po = backend.input_cost_per_token_batches, backend.output_cost_per_token_batches
    pi = backend.input_cost_per_token if pi is None else pi
    po = backend.output_cost_per_token if po is None else po
    return i, o, i * pi + o * po


class BatchSpend:
    def __init__(self, gateway: Gateway, keys: KeyStore) -> None:
        self.gw, self.keys = gateway, keys

    def _budgets(self, key: KeyRecord, money: float, model: str | None = None) -> list[Check]:
        """model: the group a finished batch ran on, whose model_max_budgets it is charged to too
        (unknown when a batch is created: its lines name theirs)."""
        team = self.gw.cfg.teams.get(key.spec.team or "")
        checks = tenant_checks(key.scope, key.spec, key.spec.team, team, 0, money, key.user_limits)
        if model is not None:
            checks += owner_model_checks(key, model, self.gw.cfg.group_of, 0, money, team)
        return [c for c in checks if c.kind == "budget"]

    async def may_create(self, key: KeyRecord) -> None:
        """Refuse a batch to a key or team whose budget is already spent (LiteLLM's: spend >=
        max_budget), as a request would be refused: 400 for a budget that never resets, else 429
        with the seconds until it does."""
        # each check asks for a hair over the float slack: refused once spend reaches the budget
        budgets = self._budgets(key, 0.0)
        checks = [Check("budget", c.scope, c.limit, c.limit * 2 * EPS, c.period) for c in budgets]
        if not checks:
            return
        rid = f"batch-create:{uuid.uuid4().hex}"
        adm = await self.gw.budgets.admit(rid, checks, 60.0, key)  # (a spend the store lost: rebuilt)
        if adm.ok:
            await self.gw.store.settle(rid, checks, [0.0] * len(checks))
            return
        spent = exceeded(adm, key.name)  # (LiteLLM's words)
        if math.isinf(adm.retry_after):
            msg = f"{spent}; it does not reset (no budget_duration)"
            raise GatewayError(400, msg, "budget_exceeded", "budget_exceeded")
        retry = max(int(adm.retry_after + 0.999), 1)
        raise limit_reached(f"{spent}; it resets in {retry} s", "budget", retry, {})

    async def created(self, key: KeyRecord, public_id: str) -> None:
        """Remember who created the batch: a master key may be the one that sees it finish. The
        key's account, not its hash: a key regenerated while its batch runs is charged as the key
        it became (its hash, revoked by then, charged no one)."""
        await self.gw.store.cache_set(f"batchapi:owner:{public_id}", key.account.encode(), TTL)

    async def _owner(self, stored: str) -> KeyRecord | None:
        """The live key of the account (or key hash) a batch's creator was remembered by: itself,
        or the key it was regenerated into (None: deleted since)."""
        rec = await self.keys.record_async(stored)
        if rec is not None:
            return rec
        recs = await self.keys.list_async()  # (once per finished batch of a regenerated key)
        account = next((k.account for k in recs if k.key_hash == stored), stored)
        live = next((k for k in recs if k.revoked is None and k.account == account), None)
        return None if live is None else await self.keys.record_async(live.key_hash)  # (with its user)

    async def seen(self, dep: Deployment, batch: dict, public_id: str) -> list[str]:
        """On every batch object the gateway hands out (its ids the gateway's): once it is
        finished, charge it (once) and return its output files' ids for the owner's file list;
        else []."""
        if batch.get("status") not in FINISHED:
            return []
        if not await self.gw.store.claim(f"batchapi:charged:{public_id}", TTL):
            return []
        files = [batch[f] for f in _OUTPUT_FILES if isinstance(batch.get(f), str) and batch[f]]
        got = await self.gw.store.cache_get(f"batchapi:owner:{public_id}")
        if got is None:  # (created before the gateway remembered owners: not charged)
            log.warning("batch %s finished; its creator is not known, so its usage is not charged", public_id)
            return files
        key_hash = got.decode()
        spent = batch_cost(dep.backend, batch.get("usage"))
        if spent is None:
            log.warning("batch %s finished on %s without a usage; nothing is charged", public_id, dep.id)
            return files
        await self._charge(key_hash, dep, public_id, *spent)
        return files

    async def _charge(
        self, key_hash: str, dep: Deployment, public_id: str, i: int, o: int, money: float
    ) -> None:
        key = await self._owner(key_hash)  # (None: deleted since; the spend is still logged)
        if key is not None and money > 0 and (checks := self._budgets(key, 0.0, dep.model_name)):
            rid = f"batch:{public_id}"
            try:  # admitted at nothing first, so a budget the store lost is rebuilt before it is charged
                await self.gw.budgets.admit(rid, checks, 60.0, key)
                await self.gw.store.settle(rid, checks, [money] * len(checks))
            except StoreUnavailable as e:
                log.warning("charging batch %s to its key failed: %s", public_id, e)
        if money:
            self.gw.metrics.spend.labels(dep.model_name).inc(money)
        alias, team, user = (key.spec.alias, key.spec.team, key.spec.user) if key is not None else (None,) * 3
        account = key.account if key is not None else key_hash  # (a key's rows go on under its first hash)
        row = SpendRow(
            time.time(), public_id, account, alias, team, dep.model_name, dep.id, i, o, money, 200, user
        )
        self.gw.spend.record(row)
        log.info("batch %s charged %.6g (%d input, %d output tokens) to key %s", public_id, money, i, o,
                 key.name if key is not None else key_hash[:12])  # fmt: skip
