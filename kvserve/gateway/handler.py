"""The life of a gateway request: check the key, admit it against its key's and team's limits,
try deployments (retries, cooldowns, fallbacks, context-window fallbacks), relay the answer,
then settle: release slots, turn the reservation into spend, log one line."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response

from kvserve.disagg.lease import release_lease
from kvserve.disagg.prefill import PrefillResult, refuses_transfer, run_prefill
from kvserve.disagg.split import decode_body, disaggregates
from kvserve.disagg.stream_start import ENGINE_GONE_CODES
from kvserve.disagg.validate import decode_refusal
from kvserve.entrypoints.openai.middleware import _REQUEST_ID
from kvserve.gateway.backends import BackendPool, estimate_tokens
from kvserve.gateway.blame import Blame
from kvserve.gateway.budget_rebuild import BudgetRebuild
from kvserve.gateway.budget_words import request_refused
from kvserve.gateway.budgets import completion_budget, cost, max_cost, sequences
from kvserve.gateway.client_params import ClientParams, take
from kvserve.gateway.config import Deployment, GatewayConfig
from kvserve.gateway.degrade import HEADER as DEGRADED_HEADER
from kvserve.gateway.degrade import Degrader
from kvserve.gateway.errors import GatewayError, limit_reached, upstream_rate_limited
from kvserve.gateway.json_type import require_json
from kvserve.gateway.keys import KeyRecord
from kvserve.gateway.limits import deployment_checks, needs_tokens, ratelimit_headers, tenant_checks
from kvserve.gateway.metrics import GatewayMetrics
from kvserve.gateway.model_limits import model_rate_refused, owner_model_checks, owner_of
from kvserve.gateway.proxy import Outcome, attempt
from kvserve.gateway.response_cache import HEADER as CACHE_HEADER
from kvserve.gateway.response_cache import Lookup, ResponseCache
from kvserve.gateway.retries import CREDENTIALS_STATUS, MAX_RETRY_AFTER, backoff
from kvserve.gateway.router import Router, request_info
from kvserve.gateway.saturation import SaturationMonitor
from kvserve.gateway.spend import SpendLog, SpendRow
from kvserve.gateway.state import Check, StateStore, StoreUnavailable
from kvserve.gateway.state.base import EPS
from kvserve.routing import RequestInfo
from kvserve.routing.in_flight import RETRY_AFTER, InFlight
from kvserve.routing.responses_ids import RESPONSES, decode_id, previous_id_problem
from kvserve.routing.settled_stream import SettledStream
from kvserve.routing.stream_failure import failed_stream_end

log = logging.getLogger("kvserve.gateway")
EMBEDDINGS = "/embeddings"  # no completion tokens, no stream, no prefill/decode split


@dataclass
class Ctx:
    """Everything one client request carries through its attempts."""

    rid: str
    key: KeyRecord
    alias: str
    body: dict
    path: str
    stream: bool
    client_usage: bool
    t0: float
    prompt_tokens: int = 0
    reserved_money: float = 0.0
    checks: list[Check] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    request: Request | None = None
    attempts: int = 0
    served_by: Deployment | None = None
    settled: bool = False
    route: RequestInfo | None = None  # what request-aware routing strategies look at
    degraded_to: str | None = None  # the fallback alias tried first: the group is saturated
    cache: Lookup | None = None  # set when the response cache applies to this request
    pd: str | None = None  # pd deployments: "disaggregated" or "fallback" (the last attempt's)
    lease: tuple[str, dict] | None = None  # a prefill's (prefill_url, kv_transfer_params) no decode took yet
    client_left: bool = False  # the client hung up (the request is being cancelled)
    abandoned: str | None = None  # it left with work on served_by: "prefill" or "answer"
    allowed: frozenset[str] = frozenset()  # the aliases this key (and its team) may use
    pinned: Deployment | None = None  # the deployment holding previous_response_id's conversation
    params: ClientParams = field(default_factory=ClientParams)  # LiteLLM's body fields (client_params.py)
    cost: float = 0.0  # what the request was charged (set when it is settled)


class Gateway:
    def __init__(
        self,
        cfg: GatewayConfig,
        store: StateStore,
        pool: BackendPool,
        spend: SpendLog,
        metrics: GatewayMetrics,
        cache_store: StateStore | None = None,
    ) -> None:
        self.cfg, self.store, self.pool, self.spend, self.metrics = cfg, store, pool, spend, metrics
        self.router = Router(cfg, store)
        self.rs = cfg.router_settings
        gs = cfg.general_settings
        self.ttl = gs.reservation_ttl or max(d.backend.timeout for d in cfg.model_list) + 30.0
        self.monitor = SaturationMonitor(cfg, pool, list(self.rs.degradation), metrics)
        self.degrader = Degrader(cfg, self.monitor, metrics)
        self.cache = ResponseCache(cfg, cache_store or store, pool, self.router)
        self.num_in_flight = 0  # client requests not yet settled (streams until they end): the drain waits
        self.budgets = BudgetRebuild(store, spend)  # admission, after a lost budget is rebuilt
        self.in_flight = InFlight("the gateway")  # what the drain's deadline ends (in_flight.py)

    # ---- entry -----------------------------------------------------------------------------
    def callable_names(self, key: KeyRecord) -> list[str]:
        """The names a key may send as `model`: groups and model_group_alias names its (and its
        team's) `models` let through (config.permits)."""
        if _team_gone(self.cfg, key):  # its team's models and limits cannot be applied: nothing
            return []
        team = self.cfg.teams.get(key.spec.team or "")
        user = key.owner.models if key.owner is not None else None  # (its user's: LiteLLM's too)
        restrictions = (key.spec.models, team.models if team else None, user)
        return [n for n in self.cfg.names() if all(self.cfg.permits(r, n) for r in restrictions)]

    def allowed_models(self, key: KeyRecord) -> list[str]:
        """The groups a key may reach, by their name or an alias's."""
        return list(dict.fromkeys(self.cfg.group_of(n) for n in self.callable_names(key)))

    def group_for(self, name: object, key: KeyRecord) -> str:
        """The group a body's `model` names, for a key that may use it; else the client's error."""
        if not isinstance(name, str) or not name:
            raise GatewayError(
                400, "model: required (one of the model names from GET /v1/models)", param="model"
            )
        if name not in self.router.groups and name not in self.rs.model_group_alias:
            raise GatewayError(404, f"model: {name!r} does not exist", code="model_not_found", param="model")
        if _team_gone(self.cfg, key):
            raise GatewayError(
                403,
                f"key: its team {key.spec.team!r} is no longer in the gateway's config: it may use no model",
                "permission_denied",
            )
        if name not in self.callable_names(key):
            raise GatewayError(
                403, f"model: this key may not use {name!r}", "permission_denied", param="model"
            )
        return self.cfg.group_of(name)  # (a model_group_alias: the group it names)

    async def handle(self, request: Request, path: str, key: KeyRecord, model: str | None = None) -> Response:
        """model: the alias a path names (Azure OpenAI's /openai/deployments/{model}/...), over the body's."""
        body = await _json_body(request)
        if model is not None:
            body["model"] = model
        alias = self.group_for(body.get("model"), key)
        allowed = frozenset(self.allowed_models(key))
        callable_ = frozenset(self.callable_names(key))
        params = take(body, path, alias, set(self.cfg.names()), callable_)  # (out of the body)
        for which in ("fallbacks", "context_window_fallbacks"):  # (a model_group_alias: its group)
            if (named := getattr(params, which)) is not None:
                setattr(params, which, list(dict.fromkeys(self.cfg.group_of(a) for a in named)))
        stream = body.get("stream") is True and path != EMBEDDINGS
        so = body.get("stream_options")
        ctx = Ctx(
            uuid.uuid4().hex,
            key,
            alias,
            body,
            path,
            stream,
            stream and isinstance(so, dict) and so.get("include_usage") is True,
            time.monotonic(),
        )
        ctx.request, ctx.allowed, ctx.params = request, allowed, params
        # one id for the client, every backend call and the log line (not ctx.rid, the state
        # store's key: a client's id may repeat); each backend made its own before, none returned
        given = request.headers.get("x-request-id", "") if request is not None else ""
        ctx.headers["x-request-id"] = given if _REQUEST_ID.fullmatch(given) else ctx.rid
        if path == RESPONSES:
            self._pin(ctx)
        ctx.route = request_info(body, request.headers if request is not None else {})
        work = asyncio.ensure_future(self._run(ctx))
        self.in_flight.waiting(work)
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            work.cancel()
            raise
        finally:
            watcher.cancel()
        if work in done:
            if work.cancelled() and self.in_flight.closing:  # the drain's deadline (routing/in_flight.py)
                retry = {"retry-after": RETRY_AFTER, "x-request-id": ctx.headers["x-request-id"]}
                msg = self.in_flight.message
                raise GatewayError(503, msg, "server_error", "shutting_down", headers=retry)
            return work.result()
        ctx.client_left = True
        work.cancel()  # the client went away: stop the upstream request (frees its KV blocks)
        return Response(status_code=499)

    def _pin(self, ctx: Ctx) -> None:
        """A Responses request continuing a stored one goes where it is stored: the deployment
        named in the gateway's id (routing/responses_ids.py), with the backend's own id."""
        prev = ctx.body.get("previous_response_id")
        if prev is None:
            return
        wrong = previous_id_problem(prev)
        if wrong is not None:  # (looked up as an id, 123 was "not found")
            raise GatewayError(400, wrong, code="invalid_value", param="previous_response_id")
        where = decode_id(prev)
        dep = self.router.by_id.get(where[0]) if where else None
        if dep is None or dep.model_name not in ctx.allowed:
            raise GatewayError(
                400,
                f"previous_response_id: response {str(prev)[:200]!r} not found (not made through this "
                "gateway, or its deployment is no longer configured)",
                code="previous_response_not_found",
                param="previous_response_id",
            )
        if dep.model_name not in self._chain(ctx):
            raise GatewayError(
                400,
                f"previous_response_id: that response was answered by model {dep.model_name!r}, whose "
                f"deployment holds the conversation; continue it with model {dep.model_name!r}",
                param="previous_response_id",
            )
        ctx.pinned, ctx.body = dep, dict(ctx.body, previous_response_id=where[1])

    async def _run(self, ctx: Ctx) -> Response:
        self.metrics.in_flight.inc()
        self.num_in_flight += 1
        try:
            await self._admit(ctx)
            resp = await self._from_cache(ctx)  # a cached answer even when the group is saturated
            if resp is None:
                if ctx.pinned is None:  # (a continued conversation cannot move to another group)
                    ctx.degraded_to = self.degrader.decide(ctx.alias, ctx.body, ctx.allowed)  # or shed 503
                resp = await self._attempts(ctx)
        except BaseException as e:
            status = (
                e.status if isinstance(e, GatewayError)
                else 503 if isinstance(e, StoreUnavailable)
                else (503 if self.in_flight.closing else 499) if isinstance(e, asyncio.CancelledError)
                else 500
            )  # fmt: skip
            if isinstance(e, GatewayError):  # (its answer names the request as a success does)
                e.headers.setdefault("x-request-id", ctx.headers["x-request-id"])
            await asyncio.shield(self._finish(ctx, status, None))
            raise
        return resp

    async def _from_cache(self, ctx: Ctx) -> Response | None:
        headers = ctx.request.headers if ctx.request is not None else None
        if ctx.path == RESPONSES:  # each answer is a stored response of its own, with its own id
            return None
        if ctx.params.no_cache or not self.cache.applies(ctx.alias, ctx.body, headers):
            return None
        ctx.cache = await self.cache.lookup(ctx.alias, ctx.path, ctx.body)
        hit = ctx.cache.hit
        self.metrics.cache.labels(ctx.alias, "miss" if hit is None else ctx.cache.match).inc()
        if hit is None:
            return None
        await self._finish(ctx, 200, None)  # no backend call: nothing spent, no tokens counted
        h = {**ctx.headers, CACHE_HEADER: "hit", "x-kvserve-cache-match": ctx.cache.match,
             "x-kvserve-model-group": ctx.alias, "x-kvserve-attempts": "0"}  # fmt: skip
        return Response(hit, 200, headers=h, media_type="application/json")

    # ---- admission -------------------------------------------------------------------------
    def _chain(self, ctx: Ctx) -> list[str]:
        """The groups to try in order: a degradation fallback first, then the alias and its
        configured fallbacks (those the key may use)."""
        first = [ctx.degraded_to] if ctx.degraded_to else []
        fallbacks = ctx.params.fallbacks  # the request's own (checked against the key), else the config's
        if fallbacks is None:
            fallbacks = self._permitted(ctx, self.rs.fallbacks)
        return list(dict.fromkeys([*first, ctx.alias, *fallbacks]))

    def _context_fallbacks(self, ctx: Ctx) -> list[str]:
        if ctx.params.context_window_fallbacks is not None:
            return ctx.params.context_window_fallbacks
        return self._permitted(ctx, self.rs.context_window_fallbacks)

    @staticmethod
    def _permitted(ctx: Ctx, fallbacks: dict[str, list[str]]) -> list[str]:
        """The alias's fallbacks the key may use: a fallback is no way around a key's `models`
        (a key limited to one group got another group's answers once the first failed)."""
        return [a for a in fallbacks.get(ctx.alias, []) if a in ctx.allowed]

    async def _admit(self, ctx: Ctx) -> None:
        key, team_name = ctx.key, ctx.key.spec.team
        team = self.cfg.teams.get(team_name or "")
        reachable = self._chain(ctx) + self._context_fallbacks(ctx)
        rule = self.rs.degradation.get(ctx.alias)
        if rule is not None and rule.fallback in ctx.allowed:  # decided after admission: reserve for it too
            reachable.append(rule.fallback)
        deps = [d for a in dict.fromkeys(reachable) for d in self.router.deployments(a)]
        probe = tenant_checks(key.scope, key.spec, team_name, team, 0, 0.0, key.user_limits)
        probe += owner_model_checks(key, ctx.alias, self.cfg.group_of, 0, 0.0, team)
        first = self.router.deployments(ctx.alias)[0]
        counting = needs_tokens(probe) or any(d.backend.tpm or d.backend.max_context for d in deps)
        if counting:  # on a deployment not cooling down: a hung one cost every request its timeout
            cooling = await self.store.cooling([d.id for d in self.router.deployments(ctx.alias)])
            counter = next((d for d in self.router.deployments(ctx.alias) if d.id not in cooling), first)
            ctx.prompt_tokens = await self.pool.count_prompt_tokens(counter, ctx.body)
        n = sequences(ctx.body)  # n x best_of x prompts: reserve less and concurrent requests overspend
        backends = [d.backend for d in deps]
        ctx.reserved_money, completion = max_cost(
            backends, ctx.body, ctx.prompt_tokens, n, completion=ctx.path != EMBEDDINGS
        )
        ctx.checks = tenant_checks(
            key.scope, key.spec, team_name, team, ctx.prompt_tokens, ctx.reserved_money, key.user_limits
        ) + owner_model_checks(key, ctx.alias, self.cfg.group_of, ctx.prompt_tokens, ctx.reserved_money, team)
        if not ctx.checks:
            return
        for c in ctx.checks:  # a cost no admission can meet: no retry helps, say what does
            if c.kind == "budget" and c.amount > c.limit * (1 + EPS):
                who = "the key's" if c.scope.startswith("key:") else f"{c.scope}'s"
                if c.model is not None:
                    owner = "the key's" if c.scope.startswith("key:") else f"{owner_of(c)}'s"
                    who = f"{owner} model_max_budget[{c.model!r}]'s"
                raise GatewayError(
                    400,
                    f"max_tokens: this request may cost up to {c.amount:.6g} ({ctx.prompt_tokens} prompt "
                    f"tokens + {completion} completion tokens x {n} sequences), more than {who} whole "
                    f"budget of {c.limit:g}; set a lower max_tokens",
                    "invalid_request_error",
                    "budget_exceeded",
                    param="max_tokens",
                    headers=ctx.headers,
                )
        adm = await self.budgets.admit(ctx.rid, ctx.checks, self.ttl, ctx.key)
        ctx.headers.update(ratelimit_headers(ctx.checks, adm))
        if not adm.ok:
            ctx.checks = []  # nothing was applied, nothing to settle
            c = adm.failed
            who = "key" if c.scope.startswith("key:") else c.scope
            if math.isinf(adm.retry_after):  # (was a 429 "retry after 1 s" that no retry ever passed)
                self.metrics.rate_limited.labels(c.kind).inc()
                raise GatewayError(
                    400,
                    request_refused(adm, key.name, None),
                    "budget_exceeded",
                    "budget_exceeded",
                    headers=ctx.headers,
                )
            what = {
                "rpm": "requests per minute",
                "tpm": "tokens per minute",
                "budget": "budget",
                "parallel": "parallel requests",
            }[c.kind]
            self.metrics.rate_limited.labels(c.kind).inc()
            retry = max(int(adm.retry_after + 0.999), 1)
            message = f"{who}: {what} limit {c.limit:g} reached; retry after {retry} s"
            if c.model is not None and c.kind != "budget":
                message = model_rate_refused(key.name, c, retry)
            if c.kind == "budget":  # (LiteLLM's words)
                message = request_refused(adm, key.name, retry)
            raise limit_reached(message, c.kind, retry, ctx.headers)

    # ---- attempts --------------------------------------------------------------------------
    async def _attempts(self, ctx: Ctx) -> Response:
        """The first answer of the group's deployments and fallbacks; a lease made for an attempt
        that failed before its decode engine answered is kept for the next one, and released
        when none takes it (no lease held till lease_s for nobody)."""
        try:
            return await self._attempts_held(ctx)
        finally:
            if ctx.lease is not None:
                release_lease(ctx.lease[1])
                ctx.lease = None

    async def _attempts_held(self, ctx: Ctx) -> Response:
        groups, context_switched = [ctx.pinned.model_name] if ctx.pinned else self._chain(ctx), False
        context_answer: tuple[Deployment, Outcome] | None = None  # a backend's own "too long" 400
        last: GatewayError | None = None
        gi = 0
        while gi < len(groups):
            alias, excluded, tried, too_long = groups[gi], set(), set(), False
            blame = Blame()
            # when each deployment that answered with a Retry-After may be asked again: not only
            # the last one to fail (a retry back to an earlier one ignored what it asked)
            group_attempts, not_before = 0, {}
            retries = self.rs.num_retries if ctx.params.num_retries is None else ctx.params.num_retries
            while group_attempts <= retries:
                if ctx.pinned is not None:  # its only deployment, even cooling down: none other has it
                    dep = None if ctx.pinned.id in excluded else ctx.pinned
                else:
                    dep = await self.router.pick(alias, excluded, tried, ctx.route)
                if dep is None:
                    break
                if dep.backend.max_context and ctx.prompt_tokens + _min_new(ctx) > dep.backend.max_context:
                    excluded.add(dep.id)
                    too_long = True
                    continue
                dchecks = deployment_checks(dep, ctx.prompt_tokens)
                arid = f"{ctx.rid}:{ctx.attempts}"
                if dchecks:
                    adm = await self.store.admit(arid, dchecks, self.ttl)
                    if not adm.ok:
                        excluded.add(dep.id)
                        retry = max(int(adm.retry_after + 0.999), 1)
                        msg = f"deployments of {alias!r} are at their limits"
                        last = limit_reached(msg, adm.failed.kind if adm.failed else "rpm", retry, {})
                        continue
                if group_attempts:
                    wait = not_before.get(dep.id, 0.0) - time.monotonic()
                    pause = backoff(
                        group_attempts,
                        self.rs.retry_backoff_base,
                        self.rs.retry_backoff_cap,
                        wait if wait > 0 else None,
                    )
                    try:
                        await asyncio.sleep(pause)
                    except BaseException:  # the client left: the deployment's slot is not used
                        await asyncio.shield(self._release(arid, dchecks, 0))
                        raise
                group_attempts += 1
                ctx.attempts += 1
                tried.add(dep.id)
                out = await self._one(ctx, dep, arid, dchecks)
                if out is not None and not isinstance(out, Outcome):
                    blame.answered_by(dep)  # (a 4xx passed through: the backend's verdict on the request)
                    await self._count_failures(blame.to_count(succeeded=out.status_code < 300))
                    return out
                if out.kind == "context":
                    too_long, context_answer = True, (dep, out)
                    excluded.add(dep.id)
                    blame.answered_by(dep)
                    continue
                self.metrics.attempts.labels(dep.id, f"failed_{out.status}").inc()
                if out.answered_error:
                    blame.hold(dep)
                else:
                    await self._count_failures([dep])
                if out.retry_after and out.retry_after > MAX_RETRY_AFTER:
                    excluded.add(dep.id)
                elif out.retry_after:
                    not_before[dep.id] = time.monotonic() + out.retry_after
                msg = f"{alias}: {out.reason} (deployment {dep.id})"
                if out.status == 429:  # busy, not broken: OpenAI's 429 (errors.py)
                    last = upstream_rate_limited(msg, out.content)
                else:
                    status = out.status if out.status >= 500 else 502
                    last = GatewayError(status, msg, "server_error", "upstream_error")
                if out.status == 429 and out.retry_after:
                    last.headers["retry-after"] = str(int(out.retry_after + 0.999))
            await self._count_failures(blame.to_count(succeeded=False))
            if too_long and not context_switched:
                context_switched, gi = True, 0
                groups = [] if ctx.pinned else self._context_fallbacks(ctx)
                if not groups and context_answer:  # nowhere bigger to go: the backend's answer stands
                    return await self._pass_through(ctx, *context_answer)
                field = "messages" if "messages" in ctx.body else "prompt"
                last = GatewayError(
                    400,
                    f"{field}: the prompt ({ctx.prompt_tokens} tokens) with max_tokens is longer than "
                    f"the context of every deployment of {alias!r} and of its context_window_fallbacks",
                    code="context_length_exceeded",
                    param=field,
                )
                continue
            gi += 1
        err = last or await self._all_cooling(ctx.alias)
        err.headers.update({**ctx.headers, "x-kvserve-attempts": str(ctx.attempts)})
        raise err

    async def _count_failures(self, deps: list[Deployment]) -> None:
        for dep in deps:
            if await self.router.failed(dep):
                self.metrics.cooldowns.labels(dep.id).inc()

    async def _all_cooling(self, alias: str) -> GatewayError:
        """The 503 of a group whose deployments all cool down, with when the first comes back
        (Retry-After: the official clients wait that long before they try again)."""
        left = await self.store.cooldown_left([d.id for d in self.router.deployments(alias)])
        err = GatewayError(
            503, f"{alias}: no deployment available (all cooling down)", "server_error", "no_deployment"
        )
        if left > 0:
            err.headers["retry-after"] = str(max(1, math.ceil(left)))
        return err

    async def _pass_through(self, ctx: Ctx, dep: Deployment, out: Outcome) -> Response:
        ctx.served_by = dep
        self.metrics.attempts.labels(dep.id, f"final_{out.status}").inc()
        await self._finish(ctx, out.status, None)
        return Response(out.content, out.status, headers=self._headers(ctx, dep), media_type=out.media_type)

    async def _one(self, ctx: Ctx, dep: Deployment, arid: str, dchecks: list[Check]) -> Response | Outcome:
        """One attempt; a Response when it is the answer, else the failed Outcome."""
        body, ctx.pd = ctx.body, None  # x-kvserve-pd describes this attempt, not an earlier one
        transfer: dict | None = None  # the producer's kv_transfer_params the decode engine gets
        # (a Responses request runs whole on the decode engine: only it holds stored conversations)
        whole = ctx.path in (EMBEDDINGS, RESPONSES)
        split = bool(dep.backend.prefill_url) and not whole and disaggregates(body)
        refused = decode_refusal(ctx.path, body) if split else None
        if refused is not None:  # the decode engine's 400, without a prefill leasing KV for nobody
            await self._release(arid, dchecks, 0)
            return await self._pass_through(ctx, dep, Outcome("final", 400, json.dumps(refused).encode()))
        if ctx.lease is not None and not (split and ctx.lease[0] == dep.backend.prefill_url):
            release_lease(ctx.lease[1])  # (another producer's: this deployment's decode would not pull it)
            ctx.lease = None
        if split and ctx.lease is not None:  # an earlier attempt's prefill: its lease still held
            transfer, ctx.pd = ctx.lease[1], "disaggregated"
        elif split:  # pd deployment: the prompt on its kv_producer first
            url, prefill = dep.backend.prefill_url + ctx.path, dict(body, model=dep.backend.model)
            try:
                send = {**self.pool.headers(dep), "x-request-id": ctx.headers["x-request-id"]}
                pre = await run_prefill(self.pool.prefill_client(dep), url, prefill, send)
            except BaseException:  # the client left during the prefill: its prompt was computed
                self._abandon(ctx, dep, "prefill")
                await asyncio.shield(self._release(arid, dchecks, ctx.prompt_tokens if ctx.abandoned else 0))
                raise
            if pre.refused_status in CREDENTIALS_STATUS:  # the deployment's key, not the client's:
                log.warning("prefill at %s refused the deployment's api_key (%d)", url, pre.refused_status)
                pre = PrefillResult(failed=True)  # the decode engine computes the prompt
            if pre.refused_status is not None:  # the client's mistake: the deployment's slot is free again
                await self._release(arid, dchecks, 0)
                return await self._pass_through(
                    ctx, dep, Outcome("final", pre.refused_status, pre.refused_content)
                )
            transfer, ctx.pd = pre.params, "disaggregated" if pre.params else "fallback"
            ctx.lease = (dep.backend.prefill_url, pre.params) if pre.params else None
        elif dep.backend.prefill_url:  # (as the pd-proxy: the transfer fields are the gateway's own)
            ctx.pd = "decode-only"
        strategy = self.router.strategy
        strategy.started(dep.id, ctx.route)
        try:
            rid = ctx.headers["x-request-id"]
            sent = decode_body(body, transfer) if dep.backend.prefill_url else body
            out = await attempt(self.pool, dep, ctx.path, sent, ctx.stream, ctx.client_usage, rid)
            if transfer and out.kind == "final" and refuses_transfer(out.status, out.content):
                # (the pd-proxy's rule: parameters the gateway set are not the client's mistake)
                log.warning("%s refused the producer's kv_transfer_params: it computes the prompt", dep.id)
                release_lease(transfer)
                ctx.pd, ctx.lease = "fallback", None
                sent = decode_body(body, None)
                out = await attempt(self.pool, dep, ctx.path, sent, ctx.stream, ctx.client_usage, rid)
        except BaseException:  # the client left while the deployment worked: it is charged
            strategy.released(dep.id, ctx.route)  # (its leaving says nothing of the deployment)
            self._abandon(ctx, dep, "prefill" if ctx.stream else "answer")
            await asyncio.shield(self._release(arid, dchecks, ctx.prompt_tokens if ctx.abandoned else 0))
            raise
        if out.kind != "retry":  # the decode engine answered: the lease is its own (pulled or released)
            ctx.lease = None
        if out.kind == "ok" and out.response is not None:  # a live stream: finished when it ends
            return self._stream(ctx, dep, arid, dchecks, out)
        if out.kind in ("final", "context"):  # the request's 4xx: no failure of the deployment's
            strategy.released(dep.id, ctx.route)
        else:
            strategy.finished(dep.id, out.first_byte_s if out.kind == "ok" else None, ctx.route)
        tokens = (out.usage or {}).get("total_tokens", ctx.prompt_tokens) if out.kind == "ok" else 0
        await self._release(arid, dchecks, tokens)
        if out.kind in ("retry", "context"):
            return out
        if out.kind == "final":
            return await self._pass_through(ctx, dep, out)
        ctx.served_by = dep
        self.metrics.attempts.labels(dep.id, "ok").inc()
        await self._finish(ctx, out.status, out.usage, ok=True)
        headers = self._headers(ctx, dep)
        headers["x-litellm-response-cost"] = str(ctx.cost)  # (LiteLLM's; its SDK reads the cost there)
        if ctx.cache is not None and out.status == 200 and dep.model_name == ctx.alias:  # not a fallback's
            await self.cache.save(ctx.cache, out.content)
            headers[CACHE_HEADER] = "miss"
        return Response(out.content, out.status, headers=headers, media_type=out.media_type)

    @staticmethod
    def _abandon(ctx: Ctx, dep: Deployment, done: str) -> None:
        """When the client left while `dep` worked on its request, note what it is charged for
        (GATEWAY.md, Budgets): a stream nothing of which was sent, its prompt; a non-streamed
        answer, its reservation on `dep`: how far the backend got before it was stopped cannot
        be known, and hanging up must not make work free."""
        if ctx.client_left:
            ctx.served_by, ctx.abandoned = dep, done

    def _headers(self, ctx: Ctx, dep: Deployment) -> dict[str, str]:
        h = {
            **ctx.headers,
            "x-kvserve-deployment": dep.id,
            "x-kvserve-attempts": str(ctx.attempts),
            "x-kvserve-model-group": dep.model_name,
            "x-litellm-model-group": dep.model_name,  # (LiteLLM's names for the same, which its users read)
            "x-litellm-model-id": dep.id,
        }
        if ctx.degraded_to is not None and dep.model_name == ctx.degraded_to:
            h[DEGRADED_HEADER] = "fallback"
        if ctx.pd is not None:
            h["x-kvserve-pd"] = ctx.pd
        return h

    def _stream(self, ctx: Ctx, dep: Deployment, arid: str, dchecks: list[Check], out: Outcome) -> Response:
        ctx.served_by = dep
        self.metrics.latency.labels(ctx.alias).observe(time.monotonic() - ctx.t0)
        deadline = time.monotonic() - (out.first_byte_s or 0) + dep.backend.timeout
        settling: list[asyncio.Future] = []

        async def settle(status: int, failure: str | None, blamed: bool = True) -> None:
            """Once: by the relay when it ends, else when the response closes (routing/settled_stream.py)."""
            first = not settling
            if first:
                settling.append(
                    asyncio.ensure_future(
                        self._end_stream(ctx, dep, arid, dchecks, out, status, failure, blamed)
                    )
                )
            try:
                await asyncio.shield(settling[0])
            except asyncio.CancelledError:
                pass  # (the client left: the settlement goes on, shielded)
            except Exception:  # a bug: said once, not swallowed (it left the key's slots held)
                if first:
                    log.exception("settling the stream of %s failed", ctx.rid)

        async def relay():
            status, failure, blamed = 499, None, True  # 499 unless the stream ends or fails
            gone = asyncio.ensure_future(_disconnected(ctx.request))  # the client went away
            try:
                yield out.first
                while True:
                    async with self.in_flight.read():  # (the drain's deadline ends a read waiting)
                        chunk = await anext(out.chunks, None)
                    if chunk is None:
                        break
                    if gone.done():
                        return  # closing the upstream response cancels the backend's work
                    data = out.relay.feed(chunk)
                    if data:
                        yield data
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"stream exceeded the total timeout of {dep.backend.timeout:g} s")
                last = out.relay.finish()
                if last:
                    yield last
                status = 200 if out.relay.error_first is None else 400  # (the request's own: proxy.py)
                if out.relay.error_later is not None:  # (it was logged and counted as a 200)
                    message, code = out.relay.error_later
                    status, failure = 502, f"the stream ended with the backend's error ({message})"
                    blamed = code in ENGINE_GONE_CODES  # the deployment's; another may be the request's
            except Exception as e:  # httpx read errors, idle and total timeouts, the drain's deadline
                status, failure = 502, f"{e.__class__.__name__}: {e}".strip(": ")
                message = f"deployment {dep.id} failed mid-stream ({failure}); the answer is incomplete"
                code = "upstream_error"
                if self.in_flight.closing:  # not the deployment's doing: no cooldown
                    status, failure, blamed, code = 503, self.in_flight.message, False, "shutting_down"
                    message = f"{failure}; the answer is incomplete"
                yield failed_stream_end(message, ctx.path == RESPONSES, out.relay.data_events, code)
            finally:
                gone.cancel()
                await settle(status, failure, blamed)

        return SettledStream(
            relay(),
            lambda: settle(499, None),
            media_type="text/event-stream",
            headers=self._headers(ctx, dep),
        )

    async def _end_stream(
        self,
        ctx: Ctx,
        dep: Deployment,
        arid: str,
        dchecks: list[Check],
        out: Outcome,
        status: int,
        failure: str | None,
        blamed: bool = True,
    ) -> None:
        await out.response.aclose()
        self.router.strategy.finished(dep.id, out.first_byte_s if failure is None else None, ctx.route)
        usage = out.relay.usage
        if usage is None:  # cut short (the backend died, the client left) or never reported:
            usage = out.relay.delivered_usage(ctx.prompt_tokens or estimate_tokens(ctx.body))  # what went out
        await self._release(arid, dchecks, usage["total_tokens"])
        self.metrics.attempts.labels(dep.id, "ok" if failure is None else "failed_mid_stream").inc()
        if failure is not None and blamed and await self.router.failed(dep):
            self.metrics.cooldowns.labels(dep.id).inc()
        await self._finish(ctx, status, usage, ok=True)

    # ---- settlement ------------------------------------------------------------------------
    async def _release(self, arid: str, dchecks: list[Check], tokens: float) -> None:
        if dchecks:
            try:
                await self.store.settle(arid, dchecks, [tokens if c.kind == "tpm" else 0 for c in dchecks])
            except StoreUnavailable as e:  # the slot expires on its own (TTL)
                log.warning("release of %s failed: %s", arid, e)

    async def _finish(self, ctx: Ctx, status: int, usage: dict | None, ok: bool = False) -> None:
        """Settle the key's and team's reservations and log the request (once)."""
        if ctx.settled:
            return
        ctx.settled = True
        dep = ctx.served_by
        money = 0.0
        if ctx.abandoned and dep is not None:
            usage, ok = _abandoned_usage(ctx, dep), True
        if ok and dep is not None:
            c = cost(dep.backend, usage)
            money = ctx.reserved_money if c is None else c  # no usage reported: charge the reservation
        ctx.cost = money
        tokens = (usage or {}).get("total_tokens", ctx.prompt_tokens) if ok else 0
        if ctx.checks:
            actual = [money if c.kind == "budget" else tokens if c.kind == "tpm" else 0 for c in ctx.checks]
            try:
                await self.store.settle(ctx.rid, ctx.checks, actual)
            except StoreUnavailable as e:  # the reservation expires on its own (TTL)
                log.warning("settle of %s failed: %s", ctx.rid, e)
        self.metrics.in_flight.dec()
        self.num_in_flight -= 1
        self.metrics.requests.labels(ctx.alias, str(status)).inc()
        if not ctx.stream:
            self.metrics.latency.labels(ctx.alias).observe(time.monotonic() - ctx.t0)
        if money:
            self.metrics.spend.labels(ctx.alias).inc(money)
        u = usage or {}
        if dep is not None:  # answered by (or at least sent to) a deployment
            self.spend.record(
                SpendRow(
                    time.time(),
                    ctx.headers.get("x-request-id", ctx.rid),  # (the id the client was answered with)
                    ctx.key.account,  # (a regenerated key's rows go on under its first hash)
                    ctx.key.spec.alias,
                    ctx.key.spec.team,
                    ctx.alias,
                    dep.id if dep else None,
                    u.get("prompt_tokens") or 0,
                    u.get("completion_tokens") or 0,
                    money,
                    status,
                    ctx.key.spec.user,
                )
            )
        log.info(
            "%s %s request_id=%s key=%s deployment=%s status=%d attempts=%d %.0fms",
            ctx.path,
            ctx.alias,
            ctx.headers.get("x-request-id", ctx.rid),
            ctx.key.name,
            dep.id if dep else "-",
            status,
            ctx.attempts,
            (time.monotonic() - ctx.t0) * 1000,
        )


def _team_gone(cfg: GatewayConfig, key: KeyRecord) -> bool:
    """A key made through the admin API for a team the config no longer has: read as a key
    without a team, it lost the team's `models` and limits (widened access, no team budget)."""
    return key.spec.team is not None and key.spec.team not in cfg.teams


def _abandoned_usage(ctx: Ctx, dep: Deployment) -> dict:
    """What a request the client left is charged as, on the deployment that had it."""
    prompt = ctx.prompt_tokens or estimate_tokens(ctx.body)
    completion = 0
    if ctx.abandoned == "answer" and ctx.path != EMBEDDINGS:
        completion = completion_budget(ctx.body, prompt, dep.backend.max_context) * sequences(ctx.body)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _min_new(ctx: Ctx) -> int:
    """Tokens the answer needs room for past the prompt (an embedding: none)."""
    if ctx.path == EMBEDDINGS:
        return 0
    b = ctx.body
    n = b.get("max_completion_tokens") or b.get("max_tokens") or b.get("max_output_tokens")
    return n if isinstance(n, int) and n > 0 else 1


async def _json_body(request: Request) -> dict:
    require_json(request)
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError:
        raise GatewayError(400, "body: not valid JSON", code="invalid_json") from None
    except RecursionError:  # the client's mistake: a 400, not a 500 and a traceback
        raise GatewayError(400, "body: not valid JSON (nested too deeply)", code="invalid_json") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "body: expected a JSON object", code="invalid_json")
    return body


async def _disconnected(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return
