"""Embeddings for the semantic cache, from a deployment of the configured alias (a kvserve
replica's /v1/embeddings, or any OpenAI-compatible one): one input, one L2-normalized vector."""

from __future__ import annotations

import math

import httpx

from kvserve.gateway.backends import JSON_HEADER, BackendPool, json_content
from kvserve.gateway.router import Router


class EmbeddingError(RuntimeError):
    """No vector: the cache then works in exact mode only for this request."""


async def embed(pool: BackendPool, router: Router, alias: str, text: str, pooling: str | None) -> list[float]:
    dep = await router.pick(alias, set(), set())
    if dep is None:
        raise EmbeddingError(f"{alias}: no deployment available for embeddings")
    body: dict = {"model": dep.backend.model, "input": text}
    if pooling is not None:
        body["pooling"] = pooling
    try:
        r = await pool.client(dep).post(
            dep.backend.base_url + "/embeddings",
            content=json_content(body),
            headers={**pool.headers(dep), **JSON_HEADER},
            timeout=dep.backend.timeout,
        )
        vec = r.json()["data"][0]["embedding"] if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise EmbeddingError(f"{dep.id}: embeddings failed ({e.__class__.__name__})") from None
    if not isinstance(vec, list) or not vec:
        raise EmbeddingError(f"{dep.id}: embeddings answered {r.status_code}")
    norm = math.sqrt(sum(x * x for x in vec)) or 1.0
    return [x / norm for x in vec]


def cosine(a: list[float], b: list[float]) -> float:
    """Of two normalized vectors (0 when their widths differ: another embedding model)."""
    return sum(x * y for x, y in zip(a, b)) if len(a) == len(b) else 0.0
