"""A model's recommended sampling defaults, from its generation_config.json, as vLLM applies them
(`--generation-config auto`, its default): a request or `LLM.generate` call that leaves one of
these unset samples with the model creator's value (Qwen2.5-Instruct: temperature 0.7, top_p 0.8,
top_k 20, repetition_penalty 1.05), not with 1.0 / 1.0 / off / 1.0. `vllm` ignores the file;
a directory reads that directory's file instead of the model's."""

from __future__ import annotations

import json
import os
from typing import Any

from kvserve.model.loader.resolve import ModelSource

# The sampling fields vLLM takes from the file (max_new_tokens is its max_tokens)
SAMPLING_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
# transformers' GenerationConfig defaults: vLLM reads the file's difference from them, so a value
# equal to one of these (top_k 50 included) changes nothing
_HF_DEFAULTS = {"repetition_penalty": 1.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0}


def generation_defaults(source: ModelSource, mode: str = "auto") -> dict[str, Any]:
    """The SamplingParams fields (max_new_tokens named max_tokens) that `mode` sets by default:
    empty for "vllm" and for a model with no generation_config.json (a GGUF file has none)."""
    if mode == "vllm":
        return {}
    folder = mode if mode != "auto" else source.path if source.kind == "hf" else None
    path = os.path.join(folder, "generation_config.json") if folder else None
    if path is None or not os.path.isfile(path):  # a directory without it is refused by EngineConfig
        return {}
    with open(path) as f:
        config = json.load(f)
    found = {k: v for k in SAMPLING_KEYS if (v := config.get(k)) is not None and v != _HF_DEFAULTS.get(k)}
    if "max_new_tokens" in found:
        found["max_tokens"] = found.pop("max_new_tokens")
    return found


def capped_max_tokens(requested: int | None, defaults: dict[str, Any], mode: str) -> int | None:
    """A server request's max_tokens, as vLLM's server has it: a `--generation-config` directory's
    max_new_tokens caps even an explicit larger value (the operator's limit); `auto`'s (the
    model's own file) only fills an unset one, which `defaults` does downstream."""
    cap = defaults.get("max_tokens") if mode not in ("auto", "vllm") else None
    return requested if cap is None or requested is None else min(requested, cap)
