"""The key a request presents, read from the headers LiteLLM's proxy reads it from, in its
order: `x-litellm-api-key` (for clients whose Authorization carries another service's
token), `Authorization: Bearer` (or `Basic <key>`, as Langfuse sends it and LiteLLM reads
it), then the headers other SDKs send their key in: `api-key`
(Azure OpenAI), `x-api-key` (Anthropic), `x-goog-api-key` (Google AI Studio) and
`Ocp-Apim-Subscription-Key` (Azure API Management). A client pointed at the gateway with
one of those SDKs was refused with a key it had sent."""

from __future__ import annotations

from collections.abc import Mapping

_OTHER_SDKS = ("api-key", "x-api-key", "x-goog-api-key", "ocp-apim-subscription-key")
_SCHEMES = ("bearer", "basic")
HOW = "send 'Authorization: Bearer <key>' (or x-litellm-api-key, api-key, x-api-key)"


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key, or None when no header carries one. The first header present decides: an
    Authorization of another scheme is no key, as LiteLLM reads it."""
    custom = headers.get("x-litellm-api-key", "").strip()
    if custom:  # its value is the key, with or without "Bearer "
        scheme, _, token = custom.partition(" ")
        return (token.strip() or None) if scheme.lower() == "bearer" else custom
    auth = headers.get("authorization", "").strip()
    if auth:
        scheme, _, token = auth.partition(" ")
        return (token.strip() or None) if scheme.lower() in _SCHEMES else None
    for name in _OTHER_SDKS:
        value = headers.get(name, "").strip()
        if value:
            return value
    return None
