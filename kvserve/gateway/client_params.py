"""Request-body fields of LiteLLM's proxy, which its users' clients send (`extra_body`): the
gateway's to read, never a backend's. A kvserve backend refuses a field it does not know with
a 400, so each is taken out of the body before anything else sees it: the ones the gateway
has the machinery for are honoured as LiteLLM honours them (per-request `fallbacks`,
`context_window_fallbacks`, `num_retries`, `disable_fallbacks`, `cache` / `caching` switches),
the ones that only label the request for LiteLLM's logging are dropped, and the testing ones
that would fake the answer are refused rather than ignored (ignoring `mock_response` would
spend real tokens on a request meant to cost nothing)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.gateway.errors import GatewayError
from kvserve.routing.responses_ids import RESPONSES

MAX_NUM_RETRIES = 10  # a client's num_retries is bounded: each retry is a backend call
# LiteLLM's labels and plumbing: dropped (they change nothing a backend computes)
DROPPED = frozenset(
    {
        "litellm_metadata", "tags", "guardrails", "timeout", "request_timeout", "max_retries",
        "proxy_server_request", "secret_fields", "litellm_call_id", "litellm_trace_id",
        "litellm_session_id", "api_key", "api_base", "base_url", "api_version", "drop_params",
        "additional_drop_params", "mock_timeout",
    }
)  # fmt: skip
REFUSED = ("mock_response", "mock_tool_calls", "mock_testing_fallbacks",
           "mock_testing_context_fallbacks", "mock_testing_rate_limit_error")  # fmt: skip


@dataclass
class ClientParams:
    """What the request asked of the gateway itself (None: the config's setting)."""

    fallbacks: list[str] | None = None
    context_window_fallbacks: list[str] | None = None
    num_retries: int | None = None
    no_cache: bool = False


def take(body: dict, path: str, alias: str, aliases: set[str], allowed: frozenset[str]) -> ClientParams:
    """Remove LiteLLM's proxy fields from `body` (in place) and read the ones the gateway
    honours; a 400 (or 403 for a model the key may not use) names a bad one."""
    for name in REFUSED:
        if body.pop(name, None) not in (None, False):  # (null or false: no mock asked for)
            raise GatewayError(
                400,
                f"{name}: LiteLLM's testing parameter is not supported by this gateway (the request would "
                "reach a real model); remove it",
                code="unsupported_parameter",
                param=name,
            )
    out = ClientParams()
    for name in [k for k in body if k in DROPPED or k.startswith("user_api_key_")]:
        del body[name]
    if "metadata" in body:
        _metadata(body, path)
    if "num_retries" in body:
        n = body.pop("num_retries")
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_NUM_RETRIES:
            raise GatewayError(
                400, f"num_retries: expected an integer from 0 to {MAX_NUM_RETRIES}", param="num_retries"
            )
        out.num_retries = n
    for name in ("fallbacks", "context_window_fallbacks"):
        if name in body:
            setattr(out, name, _aliases(name, body.pop(name), alias, aliases, allowed))
    disable = body.pop("disable_fallbacks", False)
    if disable is True:
        out.fallbacks = out.context_window_fallbacks = []
    cache, caching = body.pop("cache", None), body.pop("caching", None)
    if caching is False or (isinstance(cache, dict) and (cache.get("no-cache") or cache.get("no-store"))):
        out.no_cache = True
    return out


def _metadata(body: dict, path: str) -> None:
    """`metadata` is LiteLLM's labels, except on the Responses API, which stores OpenAI's own
    (string values) with the response: there the entries that are LiteLLM's (a value that is
    no string: tags lists, numbers, objects) are taken out, and reached the backend before
    (kvserve serve's 400 for the whole request). A metadata that is no object goes on as it
    came: the backend names the client's mistake."""
    meta = body["metadata"]
    if path != RESPONSES:
        del body["metadata"]
    elif isinstance(meta, dict) and any(not isinstance(v, str) for v in meta.values()):
        kept = {k: v for k, v in meta.items() if isinstance(v, str)}
        if kept:
            body["metadata"] = kept
        else:
            del body["metadata"]


def _aliases(name: str, value: object, alias: str, aliases: set[str], allowed: frozenset[str]) -> list[str]:
    """LiteLLM's forms: ["b", {"model": "c"}], or the router's [{"a": ["b", "c"]}] (this alias's)."""
    if not isinstance(value, list):
        raise GatewayError(400, f"{name}: expected a list of model names", param=name)
    out: list[str] = []
    for i, item in enumerate(value):
        if isinstance(item, dict) and set(item) == {"model"}:
            item = item["model"]
        if isinstance(item, dict) and len(item) == 1 and isinstance(next(iter(item.values())), list):
            (group, targets), = item.items()  # fmt: skip
            names = targets if group == alias else []
        else:
            names = [item]
        for m in names:
            if not isinstance(m, str):
                raise GatewayError(
                    400,
                    f'{name}[{i}]: expected a model name or {{"model": name}} (other per-fallback '
                    "overrides are not supported)",
                    param=name,
                )
            if m not in aliases:
                raise GatewayError(404, f"{name}[{i}]: model {m!r} does not exist", code="model_not_found",
                                   param=name)  # fmt: skip
            if m not in allowed:
                raise GatewayError(403, f"{name}[{i}]: this key may not use {m!r}", "permission_denied",
                                   param=name)  # fmt: skip
            out.append(m)
    return out
