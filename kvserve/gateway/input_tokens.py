"""POST /v1/responses/input_tokens through the gateway (OpenAI's responses.input_tokens.count):
the prompt a create would run, counted by a deployment of the model's group, or, given a
previous_response_id, by the deployment that id names (it holds the conversation), with the
backend's own id, as a create is pinned (handler.py). It was a 405: GET / DELETE
/v1/responses/{id} matched its path. It runs no model, so, as reading a stored response, it is
neither rate-limited nor charged."""

from __future__ import annotations

import json

import httpx
from fastapi import Request
from fastapi.responses import Response

from kvserve.gateway.config import Deployment
from kvserve.gateway.errors import GatewayError
from kvserve.gateway.handler import Gateway, _json_body
from kvserve.gateway.keys import KeyRecord
from kvserve.routing.responses_ids import decode_id, previous_id_problem, public_error

PREV = "previous_response_id"


def _retryable(status: int) -> bool:
    """An answer another deployment of the group may do better than: down, restarting, busy."""
    return status >= 500 or status in (408, 429)


async def _pinned(gateway: Gateway, key: KeyRecord, body: dict) -> Deployment | None:
    """The deployment holding the previous response, or None without one; the client's error
    for an id that is no string, not the gateway's, or of a group the key (or `model`) is not."""
    prev = body.get(PREV)
    if prev is None:
        return None
    if (wrong := previous_id_problem(prev)) is not None:
        raise GatewayError(400, wrong, code="invalid_value", param=PREV)
    where = decode_id(prev)
    dep = gateway.router.by_id.get(where[0]) if where else None
    if dep is None or dep.model_name not in gateway.allowed_models(key):
        raise GatewayError(
            400,
            f"{PREV}: response {str(prev)[:200]!r} not found (not made through this gateway, or its "
            "deployment is no longer configured)",
            code="previous_response_not_found",
            param=PREV,
        )
    if body.get("model") is not None and gateway.group_for(body["model"], key) != dep.model_name:
        raise GatewayError(
            400,
            f"{PREV}: that response was answered by model {dep.model_name!r}, whose deployment holds "
            f"the conversation; count it with model {dep.model_name!r}",
            param=PREV,
        )
    return dep


async def count_input_tokens(gateway: Gateway, key: KeyRecord, request: Request) -> Response:
    """The deployment's count (the first of the group that answers), its errors as it gave them."""
    body = await _json_body(request)
    dep = await _pinned(gateway, key, body)
    if dep is not None:  # (its only deployment, even cooling down: none other has the conversation)
        return await _ask(gateway, dep, dict(body, **{PREV: decode_id(body[PREV])[1]})) or _unreachable(dep)
    alias = gateway.group_for(body.get("model"), key)
    tried: set[str] = set()
    answer: Response | None = None
    while (d := await gateway.router.pick(alias, tried, tried)) is not None:
        tried.add(d.id)
        answer = await _ask(gateway, d, body) or _unreachable(d)
        if not _retryable(answer.status_code):
            break
    if answer is None:
        raise await gateway._all_cooling(alias)
    return answer


async def _ask(gateway: Gateway, dep: Deployment, body: dict) -> Response | None:
    """The deployment's answer, with the client's previous_response_id in its errors; None when
    it could not be reached."""
    b = dep.backend
    sent = dict(body, model=b.model)
    timeout = httpx.Timeout(b.first_byte_timeout, connect=b.connect_timeout)
    content = json.dumps(sent).encode()  # (escapes kept: httpx's json= refused a lone surrogate)
    try:
        client, headers = gateway.pool.client(dep), gateway.pool.headers(dep)
        r = await client.post(f"{b.base_url}/responses/input_tokens", content=content, headers=headers,
                              timeout=timeout)  # fmt: skip
    except httpx.HTTPError:
        return None
    media = r.headers.get("content-type", "application/json")
    out = r.content if r.status_code == 200 else public_error(r.content, dep.id, sent)
    return Response(out, r.status_code, media_type=media, headers={"x-kvserve-deployment": dep.id})


def _unreachable(dep: Deployment) -> Response:
    return GatewayError(
        502, f"deployment {dep.id} did not answer", "server_error", "upstream_error"
    ).response()
