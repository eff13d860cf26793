"""The model name to send when `--model` is not given: the one the server serves, from its
`GET /v1/models`. A fixed default name ran the whole benchmark against a server serving
another name, every request failing with model_not_found."""

from __future__ import annotations

from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class ServedModel:
    id: str
    """The name requests send."""
    root: str | None
    """What the server loaded it from (kvserve, vLLM): a second guess at a local tokenizer."""


def _ask(base_url: str, api_key: str | None) -> list[dict]:
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    how = "; pass --model NAME"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        r = httpx.get(url, headers=headers, timeout=10)
    except httpx.HTTPError as e:
        why = f"could not be asked which model it serves ({e})"
        raise ValueError(f"model: no --model, and {url} {why}{how}") from None
    if r.status_code in (401, 403):  # "pass --model" would not help: every request would fail so
        key = "the right --api-key" if api_key else "--api-key KEY"
        raise ValueError(f"api-key: {url} answered HTTP {r.status_code}: {r.text[:200]}; pass {key}")
    if r.status_code != 200:
        raise ValueError(f"model: no --model, and {url} answered HTTP {r.status_code}: {r.text[:200]}{how}")
    try:
        data = r.json()["data"]
        return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"model: no --model, and {url} did not answer a model list{how}") from None


def served_model(base_url: str, api_key: str | None = None) -> ServedModel:
    """The one model the server at `base_url` serves; ValueError (naming --model) when it
    serves none or several. Names that are aliases of one model (the same root, as kvserve's
    --served-model-name a b lists them) count as one: its first name is used."""
    models = _ask(base_url, api_key)
    if not models:
        raise ValueError(f"model: no --model, and {base_url} lists no model; pass --model NAME")
    roots = {m.get("root") for m in models}
    if len(models) > 1 and (len(roots) > 1 or None in roots):
        names = ", ".join(repr(m["id"]) for m in models[:10])
        raise ValueError(f"model: {base_url} serves several models ({names}); pass --model NAME")
    root = models[0].get("root")
    return ServedModel(models[0]["id"], root if isinstance(root, str) else None)
