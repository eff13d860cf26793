"""kvserve: a readable LLM serving stack (paged KV cache, continuous batching)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.entrypoints.llm import LLM
    from kvserve.outputs import CompletionOutput, Logprob, RequestOutput
    from kvserve.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"

# Where each public name lives. Imported on first use (PEP 562), so that `import kvserve.x`
# does not import torch: `kvserve serve` starts its engine process before its own heavy imports.
_HOMES = {
    "LLM": "kvserve.entrypoints.llm",
    "SamplingParams": "kvserve.sampling_params",
    "StructuredOutputsParams": "kvserve.sampling_params",
    "RequestOutput": "kvserve.outputs",
    "CompletionOutput": "kvserve.outputs",
    "Logprob": "kvserve.outputs",
}


def __getattr__(name: str):
    if name in _HOMES:
        import importlib

        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
