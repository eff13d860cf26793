"""The weight and KV cache formats' names, and their checks, without torch: the configuration
validates them in every process, the API server's included, which never imports torch."""

from __future__ import annotations

QUANT_METHODS = ("int8", "int4", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "int8")


def check_method(method: str | None) -> str | None:
    """None/'none' -> None; a known method name -> itself; anything else -> ValueError."""
    if method is None or method == "none":
        return None
    if method not in QUANT_METHODS:
        raise ValueError(f"quantization: {method!r} is not one of {', '.join(QUANT_METHODS)} (or none)")
    return method


def check_kv_cache_dtype(name: str) -> str:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return name
