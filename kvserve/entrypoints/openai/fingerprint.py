"""`system_fingerprint`: OpenAI's name for the backend configuration a response came from.
Clients compare it across responses to tell whether a seeded request may answer differently
because the server changed, so it is derived from what changes the tokens drawn: the weights,
their precision, the decoding method and the kvserve release."""

from __future__ import annotations

import hashlib
import json

from kvserve import __version__

SETTINGS = (
    "dtype", "device", "quantization", "kv_cache_dtype", "speculative_method", "speculative_model",
    "num_speculative_tokens", "tensor_parallel_size", "pipeline_parallel_size", "generation_config",
)  # fmt: skip


def system_fingerprint(config: object, source: str) -> str:
    """`fp_` and 10 hex digits, the same for every server started with these settings."""
    parts = {"kvserve": __version__, "model": str(source), **{k: getattr(config, k, None) for k in SETTINGS}}
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
    return "fp_" + digest[:10]
