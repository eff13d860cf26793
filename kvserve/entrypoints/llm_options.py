"""vLLM's `LLM(...)` options that kvserve's EngineConfig lacks. Scripts written for vLLM pass
them routinely (`trust_remote_code=True`, `dtype="auto"`): each was a TypeError or a ValueError
before the model loaded. Those with no effect here are accepted; a value kvserve cannot honour
is refused naming the option."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from kvserve.config import EngineConfig, vllm_dtype

_ANY = object()
_ENGINE_FIELDS = {f.name for f in fields(EngineConfig)}

# option -> (values accepted and dropped, why another is refused)
VLLM_LLM_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    # kvserve builds its architectures itself and never runs a model repository's own code
    "trust_remote_code": ((_ANY,), ""),
    "tokenizer_mode": (("auto",), "only the model's own (fast) tokenizer is used"),
    "swap_space": ((_ANY,), ""),  # no CPU swap: a preempted request is recomputed
    "disable_log_stats": ((_ANY,), ""),  # the offline engine logs no stats
    "revision": ((None,), "a model revision is not supported; pass the downloaded directory"),
    "tokenizer_revision": ((None,), "a tokenizer revision is not supported"),
    # kvserve always splits long prompts into chunks under max_num_batched_tokens
    "enable_chunked_prefill": ((None, True), "prompts are always prefilled in chunks"),
    "load_format": ((None, "auto", "safetensors", "gguf"), "weights load from safetensors or GGUF files"),
    "download_dir": ((_ANY,), ""),  # nothing is downloaded: the model is a local directory or file
    "max_logprobs": ((_ANY,), ""),  # offline, logprobs go up to the vocabulary size
    "compilation_config": ((_ANY,), ""),  # no torch.compile here
    "max_seq_len_to_capture": ((_ANY,), ""),  # CUDA graphs are sized by the engine itself
}


def engine_options(model: str, given: dict[str, Any]) -> dict[str, Any]:
    """`given` without vLLM's options that change nothing here; raises ValueError for others."""
    kept = {}
    for name, value in given.items():
        if name == "dtype":  # vLLM's spellings (auto, float, half, ...) and torch dtypes
            value = vllm_dtype(str(value).removeprefix("torch."))
            if value is None:  # auto: kvserve's own default dtype
                continue
        if name == "kv_cache_dtype" and value == "fp8":  # vLLM's name for e4m3 (on CUDA)
            value = "fp8_e4m3"
        if name == "tokenizer" and (value is None or value == model):  # the model's own
            continue
        if name not in VLLM_LLM_ONLY:
            if name not in _ENGINE_FIELDS:  # was EngineConfig's TypeError, naming no LLM option
                raise TypeError(
                    f"LLM() got an unexpected keyword argument {name!r}: neither an EngineConfig field "
                    "nor a vLLM option kvserve takes"
                )
            kept[name] = value
            continue
        accepted, why = VLLM_LLM_ONLY[name]
        if _ANY not in accepted and value not in accepted:
            raise ValueError(f"{name}: {value!r} is not supported; {why}")
    return kept
