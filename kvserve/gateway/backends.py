"""One bounded httpx connection pool per deployment, and prompt-token counting with the
deployment's own tokenizer when it is a kvserve replica (its /tokenize), else an estimate."""

from __future__ import annotations

import json

import httpx

from kvserve.gateway.config import Deployment, GatewayConfig


def estimate_tokens(body: dict) -> int:
    """~4 characters a token plus a few per message: close enough for admission, corrected by
    the usage the backend reports."""
    if "messages" in body:
        msgs = body.get("messages") or []
        return sum(4 + len(json.dumps(m.get("content") if isinstance(m, dict) else m)) // 4 for m in msgs) + 2
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
        return len(prompt)
    return len(json.dumps(prompt)) // 4 + 1


def _tokenize_payload(dep: Deployment, body: dict) -> dict | None:
    if "messages" in body:
        msgs = []
        for m in body.get("messages") or []:
            if not isinstance(m, dict):
                return None
            content = m.get("content") or ""
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            msgs.append({"role": m.get("role", "user"), "content": content})
        return {"model": dep.backend.model, "messages": msgs}
    if isinstance(body.get("prompt"), str):
        return {"model": dep.backend.model, "prompt": body["prompt"]}
    return None


class BackendPool:
    def __init__(self, cfg: GatewayConfig) -> None:
        self.clients: dict[str, httpx.AsyncClient] = {}
        self.tokenizer: dict[str, str] = {}
        for d in cfg.model_list:
            b = d.backend
            self.clients[d.id] = httpx.AsyncClient(
                timeout=httpx.Timeout(
                    b.timeout, connect=b.connect_timeout, read=b.idle_timeout, pool=b.timeout
                ),
                limits=httpx.Limits(
                    max_connections=b.max_connections, max_keepalive_connections=b.max_connections
                ),
            )
            self.tokenizer[d.id] = b.tokenizer

    def client(self, dep: Deployment) -> httpx.AsyncClient:
        return self.clients[dep.id]

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
            r = await self.clients[dep.id].post(
                root + "/tokenize",
                json=payload,
                headers=self.headers(dep),
                timeout=dep.backend.connect_timeout,
            )
        except httpx.HTTPError:
            return estimate_tokens(body)  # down right now: the attempt itself will find out
        if r.status_code == 200 and isinstance(r.json().get("count"), int):
            self.tokenizer[dep.id] = "kvserve"
            return r.json()["count"]
        if mode == "auto" and r.status_code in (401, 403, 404, 405):
            self.tokenizer[dep.id] = "estimate"
        return estimate_tokens(body)

    async def probe(self, dep: Deployment) -> bool:
        """Readiness: does the backend answer GET /models?"""
        try:
            r = await self.clients[dep.id].get(
                dep.backend.base_url + "/models", headers=self.headers(dep), timeout=2.0
            )
            return r.status_code < 500
        except httpx.HTTPError:
            return False

    async def close(self) -> None:
        for c in self.clients.values():
            await c.aclose()
