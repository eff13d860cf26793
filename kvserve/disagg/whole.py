"""What the pd-proxy sends whole to one decode engine, without a prefill: the Responses API
(POST /v1/responses, GET and DELETE /v1/responses/{id}, GET .../input_items) and /v1/embeddings.

A Responses request is an envelope over chat whose stored conversation (store, then
previous_response_id, GET, DELETE) lives on the engine that answered; split across a prefill
and a decode engine it would need the prefill engine to hold that conversation too. So it
runs on a decode engine, as vLLM's PD routers send what they do not split, and the ids the
client gets name that engine (routing/responses_ids.py: a hash of its URL, not the URL), so
a follow-up reaches it through any proxy given the same --decode URLs. Embeddings run no
decode: the decode engines serve them, in turn, as the gateway's pd deployments do."""

from __future__ import annotations

import hashlib
from urllib.parse import quote

import httpx
from fastapi.responses import JSONResponse, Response

from kvserve.disagg.errors import error, unreachable
from kvserve.routing.responses_ids import decode_id, public_body


def engine_tag(url: str) -> str:
    """The decode engine as a Responses id names it: stable across restarts and orders of
    --decode, and without the internal address."""
    return "d" + hashlib.sha256(url.encode()).hexdigest()[:12]


class StoredResponses:
    """Which decode engine a public Responses id names, and the requests made to it."""

    def __init__(self, decode: list[str]) -> None:
        self.by_tag = {engine_tag(u): u for u in decode}

    def where(self, public_id: object) -> tuple[str, str] | None:
        """(decode engine URL, the engine's own id), or None for an id this proxy did not make
        or whose engine is no longer one of its --decode engines."""
        found = decode_id(public_id)
        url = self.by_tag.get(found[0]) if found else None
        return (url, found[1]) if url else None

    @staticmethod
    def previous_not_found(prev: object) -> JSONResponse:
        msg = (
            f"previous_response_id: response {str(prev)[:200]!r} not found (not made through this "
            "proxy, or the decode engine holding it is no longer one of its --decode engines)"
        )
        return JSONResponse(error(msg, "previous_response_id", code="previous_response_not_found"), 400)

    async def request(
        self, client: httpx.AsyncClient, method: str, public_id: str, query: str, headers: dict,
        tail: str = "",
    ) -> Response:  # fmt: skip
        """GET or DELETE on the engine holding the response (`tail`: "/input_items", its input
        items), with the proxy's ids."""
        where = self.where(public_id)
        if where is None:
            return _not_found(public_id)
        url, own_id = where
        target = f"{url}/v1/responses/{quote(own_id, safe='')}{tail}" + (f"?{query}" if query else "")
        try:
            r = await client.request(method, target, headers=headers)
        except httpx.HTTPError as e:
            return unreachable(url, e)
        if r.status_code == 404:  # (the engine's message names its own id)
            return _not_found(public_id)
        content = public_body(r.content, engine_tag(url)) if r.status_code == 200 else r.content
        return Response(content, r.status_code, media_type=r.headers.get("content-type", "application/json"))


def _not_found(public_id: str) -> JSONResponse:
    msg = (
        f"response {public_id[:200]!r} not found (not made through this proxy, deleted, or no longer "
        "held by its decode engine)"
    )
    return JSONResponse(error(msg, None, code="not_found"), 404)
