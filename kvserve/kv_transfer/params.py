"""The per-request `kv_transfer_params` (vLLM's field and key names), both directions.

To a producer: `{"do_remote_decode": true}`: keep this prompt's blocks for a decode engine.
Its response carries the parameters for the consumer: `do_remote_prefill`, where the blocks
are (`remote_host`, `remote_port`, `remote_request_id`: the lease), how many tokens they
hold (`remote_num_tokens`: the prompt less its last token, which the consumer computes to
get its first token's logits), a digest of those tokens (a consumer whose prompt differs
computes it itself) and the connector.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Any

_KEYS = {
    "do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_host", "remote_port",
    "remote_request_id", "remote_num_tokens", "prompt_digest", "kv_connector",
    "remote_block_ids", "tp_size",  # vLLM's, accepted and not needed here
}  # fmt: skip


def prompt_digest(token_ids: list[int]) -> str:
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()[:32]


@dataclass(frozen=True)
class RemotePrefill:
    """Where a consumer pulls a request's prompt KV from."""

    request_id: str  # the producer's lease
    num_tokens: int
    digest: str
    connector: str
    host: str | None = None
    port: int | None = None
    engine_id: str | None = None


def _bad(key: str, why: str) -> ValueError:
    return ValueError(f"kv_transfer_params: {key}: {why}")


def check_kv_transfer_params(p: Any) -> dict | None:
    """Refuse malformed parameters at the API with the key that is wrong; returns them."""
    if p is None:
        return None
    if not isinstance(p, dict):
        raise ValueError("kv_transfer_params: must be an object")
    for key in p:
        if key not in _KEYS:
            raise _bad(key, "unknown key")
    for key in ("do_remote_decode", "do_remote_prefill"):
        if key in p and p[key] is not None and not isinstance(p[key], bool):
            raise _bad(key, "must be a boolean")
    if p.get("do_remote_decode") and p.get("do_remote_prefill"):
        raise _bad("do_remote_prefill", "cannot be combined with do_remote_decode")
    if p.get("do_remote_prefill"):
        for key in ("remote_request_id", "prompt_digest", "kv_connector"):
            if not isinstance(p.get(key), str) or not p[key]:
                raise _bad(key, "required (a string) with do_remote_prefill")
        n = p.get("remote_num_tokens")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise _bad("remote_num_tokens", "required (a positive integer) with do_remote_prefill")
        if p["kv_connector"] != "disk":
            port = p.get("remote_port")
            if not isinstance(p.get("remote_host"), str) or not p["remote_host"]:
                raise _bad("remote_host", f"required with kv_connector {p['kv_connector']!r}")
            if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                raise _bad("remote_port", f"required (1-65535) with kv_connector {p['kv_connector']!r}")
    return p


def check_one_prompt(params: dict | None, num_prompts: int) -> None:
    """Parameters belong to one prompt: a producer leases each prompt's KV but its answer has
    room for one set (the other leases were held for nobody until lease_s), and a consumer's
    prompts would all name one lease. vLLM's P/D proxies send one prompt per request."""
    if params and num_prompts > 1:
        raise ValueError(
            f"kv_transfer_params: needs one prompt, got {num_prompts} (send each prompt in its own request)"
        )


def remote_tokens(params: dict | None, prompt_len: int) -> int:
    """The prompt tokens a consumer expects from its producer (checked parameters): it computes
    only the rest, so its backlog of prompt tokens (kvserve:num_waiting_prefill_tokens, a
    router's load) counts only the rest; it counted the whole prompt."""
    rp = remote_prefill(params)
    return 0 if rp is None else max(0, min(rp.num_tokens, prompt_len - 1))


def wants_remote_decode(params: dict | None) -> bool:
    return bool(params and params.get("do_remote_decode"))


def remote_prefill(params: dict | None) -> RemotePrefill | None:
    """The consumer's side of checked parameters (None: compute the prompt here)."""
    if not params or not params.get("do_remote_prefill"):
        return None
    return RemotePrefill(
        params["remote_request_id"], params["remote_num_tokens"], params["prompt_digest"],
        params["kv_connector"], params.get("remote_host"), params.get("remote_port"),
        params.get("remote_engine_id"),
    )  # fmt: skip
