"""One bounded httpx connection pool per deployment, and prompt-token counting with the
deployment's own tokenizer when it is a kvserve replica (its /tokenize), else an estimate."""

from __future__ import annotations

import json

import httpx

from kvserve.gateway.body import content_text, messages_of
from kvserve.gateway.config import Deployment, GatewayConfig
from kvserve.gateway.counted_client import CountedClient
from kvserve.gateway.retries import CREDENTIALS_STATUS


def json_content(obj: object) -> bytes:
    """A JSON body as the client's own was: ASCII with escapes, so a lone surrogate ("\\ud800",
    valid JSON) goes on escaped; httpx's json= encodes strict UTF-8 and raised on it."""
    return json.dumps(obj).encode()


JSON_HEADER = {"content-type": "application/json"}


def estimate_tokens(body: dict) -> int:
    """~4 characters a token plus a few per message: close enough for admission, corrected by
    the usage the backend reports."""
    if "messages" in body:
        msgs = messages_of(body)
        return sum(4 + len(json.dumps(m.get("content") if isinstance(m, dict) else m)) // 4 for m in msgs) + 2
    prompt = body.get("prompt", body.get("input", ""))  # input: /v1/embeddings
    if isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
        return len(prompt)
    return len(json.dumps(prompt)) // 4 + 1


def _tokenize_payload(dep: Deployment, body: dict) -> dict | None:
    if "messages" in body:
        msgs = []
        for m in messages_of(body):
            if not isinstance(m, dict) or not isinstance(m.get("role", "user"), str):
                return None
            msgs.append({"role": m.get("role", "user"), "content": content_text(m.get("content"))})
        return {"model": dep.backend.model, "messages": msgs} if msgs else None
    text = body.get("prompt", body.get("input"))  # input: /v1/embeddings
    if isinstance(text, str):
        return {"model": dep.backend.model, "prompt": text}
    return None


POOL_SHARD = 4  # connections per httpx client: one client's pool slows down sharply past a few dozen
AUX_CONNECTIONS = 8  # per deployment, for /tokenize, readiness probes and /metrics polls (aux_client)


def least_busy(shards: list[CountedClient], start: int) -> CountedClient:
    """The shard with the fewest requests in flight, ties going to the first from `start`: in
    turn alone, alternating long and short streams piled the long ones onto half the shards,
    and a request waited for a connection there while the other half sat idle."""
    n = len(shards)
    return min((shards[(start + k) % n] for k in range(n)), key=lambda c: c.in_flight)


class BackendPool:
    """Per deployment, max_connections split over small httpx clients, each request to the
    least busy: 64 concurrent requests through one 64-connection client ran at 52 req/s,
    through 16 clients of 4 at 309 (`benchmarks/bench_gateway.py pools`, docs/BENCHMARKS.md)."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.clients: dict[str, list[CountedClient]] = {}
        self._next: dict[str, int] = {}
        self._next_prefill: dict[str, int] = {}
        self.tokenizer: dict[str, str] = {}
        self.aux: dict[str, httpx.AsyncClient] = {}
        tls = httpx.create_ssl_context()  # built once: one per client made start-up take minutes
        for d in cfg.model_list:
            b = d.backend
            shards = max(1, -(-b.max_connections // POOL_SHARD))
            per = min(POOL_SHARD, b.max_connections)
            timeout = httpx.Timeout(b.timeout, connect=b.connect_timeout, read=b.idle_timeout, pool=b.timeout)
            limits = httpx.Limits(max_connections=per, max_keepalive_connections=per)
            self.clients[d.id] = [
                CountedClient(timeout=timeout, limits=limits, verify=tls) for _ in range(shards)
            ]
            self._next[d.id] = self._next_prefill[d.id] = 0
            self.tokenizer[d.id] = b.tokenizer
            aux = httpx.Limits(max_connections=AUX_CONNECTIONS, max_keepalive_connections=AUX_CONNECTIONS)
            self.aux[d.id] = httpx.AsyncClient(timeout=timeout, limits=aux, verify=tls)

    def client(self, dep: Deployment) -> httpx.AsyncClient:
        shards = self.clients[dep.id]
        i = self._next[dep.id] = (self._next[dep.id] + 1) % len(shards)
        return least_busy(shards, i)

    def prefill_client(self, dep: Deployment) -> httpx.AsyncClient:
        """A pd deployment's prefill call: the same shards, ties broken in a turn of their own. In
        the requests' turn each request took two (prefill, then decode), so with an even number
        of shards every prefill landed on one half and every decode on the other: half of
        max_connections for each."""
        shards = self.clients[dep.id]
        i = self._next_prefill[dep.id] = (self._next_prefill[dep.id] + 1) % len(shards)
        return least_busy(shards, i)

    def aux_client(self, dep: Deployment) -> httpx.AsyncClient:
        """The client for the gateway's own calls (/tokenize, readiness, /metrics), outside the
        requests' shards: on a shard they took a turn, so a counted request (its /tokenize, then
        its answer) took two and with an even number of shards every request landed on half of
        them (max_connections 8 served 4 at once); and behind a full pool a busy deployment's
        readiness probe timed out, read as down."""
        return self.aux[dep.id]

    @staticmethod
    def headers(dep: Deployment) -> dict[str, str]:
        h = {"content-type": "application/json"}
        if dep.backend.api_key:
            h["authorization"] = f"Bearer {dep.backend.api_key}"
        return h

    async def count_prompt_tokens(self, dep: Deployment, body: dict) -> int:
        """kvserve's /tokenize when the deployment has one (found out once, in 'auto' mode)."""
        mode = self.tokenizer[dep.id]
        payload = _tokenize_payload(dep, body) if mode != "estimate" else None
        if payload is None:
            return estimate_tokens(body)
        root = dep.backend.base_url.removesuffix("/v1")
        try:
            r = await self.aux_client(dep).post(
                root + "/tokenize",
                content=json_content(payload),
                headers={**self.headers(dep), **JSON_HEADER},
                timeout=dep.backend.connect_timeout,
            )
        except httpx.HTTPError:
            return estimate_tokens(body)  # down right now: the attempt itself will find out
        try:
            count = r.json().get("count") if r.status_code == 200 else None
        except (ValueError, AttributeError):
            count = None
        if isinstance(count, int):
            self.tokenizer[dep.id] = "kvserve"
            return count
        if mode == "auto" and r.status_code < 500 and r.status_code not in (400, 422):
            self.tokenizer[dep.id] = "estimate"  # no kvserve /tokenize there: stop asking (a 400
            # is kvserve's verdict on this body, and must not turn counting off for the others)
        return estimate_tokens(body)

    async def probe(self, dep: Deployment) -> bool:
        """Readiness: does the backend answer GET /models? (A 404 is an answer: not every server
        has the route; a 401/403 refuses the deployment's api_key, so it would refuse every
        request too.)"""
        try:
            r = await self.aux_client(dep).get(
                dep.backend.base_url + "/models", headers=self.headers(dep), timeout=2.0
            )
            return r.status_code < 500 and r.status_code not in CREDENTIALS_STATUS
        except httpx.HTTPError:
            return False

    async def close(self) -> None:
        for shards in self.clients.values():
            for c in shards:
                await c.aclose()
        for c in self.aux.values():
            await c.aclose()
