"""The prefill half of a disaggregated request, shared by `kvserve pd-proxy` and the gateway's
pd deployments (a backend with `prefill_url`)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import httpx

from kvserve.disagg.split import JSON_HEADER, json_content, prefill_body

logger = logging.getLogger(__name__)


@dataclass
class PrefillResult:
    """`params` for the decode engine (None: it computes the prompt itself), or, when the
    prefill engine refused the request (a 4xx: the client's mistake), its answer to pass on."""

    params: dict | None = None
    refused_status: int | None = None
    refused_content: bytes = b""
    failed: bool = False  # the engine could not be reached or failed (another may answer)


async def run_prefill(
    client: httpx.AsyncClient, url: str, body: dict, headers: dict, timeout: float | None = None
) -> PrefillResult:
    """POST the prefill body to `url`; any failure of the prefill engine means a fallback, a
    silent one after `timeout` seconds (None: the client's own timeouts)."""
    limit = httpx.USE_CLIENT_DEFAULT if timeout is None else httpx.Timeout(timeout, connect=min(timeout, 5.0))
    try:
        resp = await client.post(
            url, content=json_content(prefill_body(body)), headers={**headers, **JSON_HEADER}, timeout=limit
        )
    except httpx.HTTPError as e:
        logger.warning("prefill at %s failed (%s)", url, e)
        return PrefillResult(failed=True)
    if resp.status_code == 404:  # the route or model is not there: the engine set up wrong, not the request
        logger.warning("prefill at %s answered 404 (no such route or model)", url)
        return PrefillResult(failed=True)
    if 400 <= resp.status_code < 500 and resp.status_code not in (408, 429):
        if refuses_transfer(resp.status_code, resp.content):  # (the parameters are ours, not the client's)
            logger.warning("prefill at %s refused kv_transfer_params (not a kv_producer?)", url)
            return PrefillResult(failed=True)
        return PrefillResult(refused_status=resp.status_code, refused_content=resp.content)
    if resp.status_code != 200:
        logger.warning("prefill at %s answered %d", url, resp.status_code)
        return PrefillResult(failed=True)
    try:
        answer = resp.json()
    except (ValueError, RecursionError):
        answer = None
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(params, dict):  # (an engine answering anything else: it computes the prompt)
        params = None
    if not params:
        logger.warning("prefill at %s answered without kv_transfer_params (not a kv_producer?)", url)
    return PrefillResult(params or None)


def refuses_transfer(status: int, content: bytes) -> bool:
    """Whether an engine's answer refuses the transfer parameters, which the proxy always sets
    itself (split.py), never the client: a --prefill engine without --kv-transfer-config or a
    kv_consumer, or a decode engine that will not pull from the producer named (its
    kv_producers), is set up wrong, as one answering 404 is; its 400 went to every client as
    their own mistake, naming a field they never sent."""
    if not 400 <= status < 500:
        return False
    try:
        err = json.loads(content).get("error")
    except (ValueError, RecursionError, AttributeError):
        return False
    return isinstance(err, dict) and err.get("param") == "kv_transfer_params"
