"""vLLM's SamplingParams fields that kvserve's lacks: at vLLM's default they are accepted (code
written for vLLM often spells them out), otherwise refused with a ValueError naming the field
and why. They were a bare TypeError ("unexpected keyword argument") from the dataclass."""

from __future__ import annotations

from typing import Any

_UNSET = object()

# name -> (the values that change nothing here, why any other is refused)
VLLM_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((None,), "not supported offline (as vLLM V1's LLM); rank n samples by cumulative_logprob"),
    "detokenize": ((True,), "False is not supported: the text is always decoded"),
    "spaces_between_special_tokens": ((True,), "False is not supported"),
    "output_kind": ((_UNSET,), ""),  # LLM.generate returns finished outputs only, as vLLM's does
    "guided_decoding": ((None,), "use structured_outputs=StructuredOutputsParams(...) (vLLM's newer name)"),
    "logits_processors": ((None, ()), "not supported: kvserve runs no per-request Python on the logits"),
    "extra_args": ((None,), "not supported"),
    "flat_logprobs": ((False,), "not supported: logprobs are a list of dicts"),
}


def check_vllm_only(given: dict[str, Any]) -> None:
    """Drop the vLLM-only fields in `given` that are at a value with no effect; raise for others."""
    for name in [k for k in given if k in VLLM_ONLY]:
        harmless, why = VLLM_ONLY[name]
        value = given.pop(name)
        if _UNSET in harmless or any(_same(value, h) for h in harmless):
            continue
        raise ValueError(f"{name}: {why} (a vLLM SamplingParams field kvserve does not take)")


def _same(value: Any, harmless: Any) -> bool:
    if harmless == ():
        return isinstance(value, list | tuple) and not value
    return value is harmless or (type(value) is type(harmless) and value == harmless)
