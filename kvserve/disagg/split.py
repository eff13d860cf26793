"""How one client request becomes a prefill request and a decode request.

The prefill engine computes the prompt and one token (which nobody sees) and keeps the
prompt's KV under a lease; its response's `kv_transfer_params` go with the client's own
body to the decode engine, which pulls the KV and produces the whole answer, streamed or
not, as if it had computed the prompt itself.
"""

from __future__ import annotations

import json

JSON_HEADER = {"content-type": "application/json"}

# logprobs / top_logprobs stay: the prefill engine checks them against its --max-logprobs (the
# proxy cannot know the decode engines' cap), at the cost of one token's alternatives
_DROP_FOR_PREFILL = ("stream_options", "n", "best_of", "max_completion_tokens")


def disaggregates(body: dict) -> bool:
    """Whether a request goes prefill -> decode. Several sequences from one prompt (n, best_of,
    beams), several prompts (a completions batch: the producer leases every prompt's KV but
    answers one set of parameters, so the others' blocks were held for nobody until lease_s)
    and prompt logprobs (every prompt position scored where it is decoded: `prompt_logprobs`,
    or a completion's `echo` with `logprobs`, how eval harnesses score a prompt; it was
    prefilled and leased for a consumer that computes the prompt anyway) go to the decode
    engine alone."""
    n, best_of = body.get("n") or 1, body.get("best_of") or 1
    echo_scored = bool(body.get("echo")) and body.get("logprobs") is not None and "messages" not in body
    return (
        n == 1 and best_of == 1 and not body.get("use_beam_search") and body.get("prompt_logprobs") is None
        and not echo_scored and not _several_prompts(body.get("prompt"))
    )  # fmt: skip


def _several_prompts(prompt: object) -> bool:
    """A list of more than one prompt (strings or token-id lists); a list of ids is one prompt."""
    return isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int)


def prefill_body(body: dict) -> dict:
    out = {k: v for k, v in body.items() if k not in _DROP_FOR_PREFILL}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    out.pop("min_tokens", None)
    return out


def decode_body(body: dict, kv_transfer_params: dict | None) -> dict:
    """The client's body, with the producer's parameters (None: the decode engine computes
    the prompt itself, e.g. after the prefill engine failed)."""
    out = dict(body)
    out.pop("kv_transfer_params", None)
    if kv_transfer_params:
        out["kv_transfer_params"] = kv_transfer_params
    return out


def json_content(body: dict) -> bytes:
    """A body for an engine as the client's own was: ASCII JSON with escapes, so a lone
    surrogate ("\\ud800", valid JSON) goes on escaped; httpx's json= encodes strict UTF-8 and
    raised on it."""
    return json.dumps(body).encode()
