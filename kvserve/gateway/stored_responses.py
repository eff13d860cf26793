"""GET and DELETE /v1/responses/{id} (GET .../input_items, POST .../cancel) through the gateway: to the
deployment the id names (routing/responses_ids.py), for a key that may use that deployment's
model. Reading or deleting a stored response runs no model, so it is neither rate-limited nor
charged."""

from __future__ import annotations

from urllib.parse import quote

import httpx
from fastapi.responses import Response

from kvserve.gateway.errors import GatewayError
from kvserve.gateway.handler import Gateway
from kvserve.gateway.keys import KeyRecord
from kvserve.routing.responses_ids import decode_id, public_body


def _not_found(public_id: str) -> GatewayError:
    return GatewayError(
        404,
        f"response {public_id[:200]!r} not found (not made through this gateway, deleted, or no longer "
        "held by its deployment)",
        code="not_found",
    )


async def stored_response(
    gateway: Gateway, key: KeyRecord, method: str, public_id: str, query: str, tail: str = ""
) -> Response:
    """The deployment's answer to `method` on the stored response (`tail`: "/input_items", its
    input items; "/cancel"), with the gateway's ids."""
    where = decode_id(public_id)
    dep = gateway.router.by_id.get(where[0]) if where else None
    if dep is None or dep.model_name not in gateway.allowed_models(key):
        raise _not_found(public_id)  # (another key's model: not said to exist)
    b = dep.backend
    url = f"{b.base_url}/responses/{quote(where[1], safe='')}{tail}" + (f"?{query}" if query else "")
    timeout = httpx.Timeout(b.first_byte_timeout, connect=b.connect_timeout)
    try:
        client, headers = gateway.pool.client(dep), gateway.pool.headers(dep)
        r = await client.request(method, url, headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        raise GatewayError(
            502,
            f"deployment {dep.id}, which holds this response, did not answer ({e.__class__.__name__})",
            "server_error",
            "upstream_error",
        ) from None
    if r.status_code == 404:  # the backend's message names its own id
        raise _not_found(public_id)
    content = public_body(r.content, dep.id) if r.status_code == 200 else r.content
    media = r.headers.get("content-type", "application/json")
    return Response(content, r.status_code, media_type=media, headers={"x-kvserve-deployment": dep.id})
