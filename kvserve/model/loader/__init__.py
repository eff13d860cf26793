"""Model loading: resolve the source, build the model, fill its weights, get a tokenizer.

The model's modules (and torch) are imported when a model is built, not with this package:
the API server process imports it for `resolve_model` and `load_tokenizer` only, and never
runs a model (torch is ~1 s of its start and ~200 MB of its memory)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.model.arch import ModelArch
from kvserve.model.loader.gguf_file import gguf_reader, release_gguf_reader
from kvserve.model.loader.resolve import ModelSource, resolve_model, resolve_tokenizer
from kvserve.model.loader.tokenizer_loader import load_tokenizer
from kvserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

    from kvserve.model.models.llama import LlamaForCausalLM

__all__ = [
    "load_arch",
    "load_model",
    "load_tokenizer",
    "load_weights_only",
    "resolve_model",
    "resolve_tokenizer",
    "ModelSource",
]


def load_arch(source: ModelSource) -> ModelArch:
    """Only the architecture (what the engine needs to size the KV pool before any rank loads)."""
    if source.kind == "hf":
        from kvserve.model.loader.hf_loader import hf_arch

        return hf_arch(source.path)
    from kvserve.model.loader.gguf_loader import gguf_arch

    return gguf_arch(gguf_reader(source.path))


def load_model(
    source: ModelSource, dtype: torch.dtype, device: torch.device, quantization: str | None = None
) -> tuple[LlamaForCausalLM, Tokenizer]:
    """The model on `device` and its tokenizer; `quantization` (int8 | int4 | fp8) quantizes the
    projections while loading (GGUF tensors with a matching format are taken as they are)."""
    return load_weights_only(source, dtype, device, quantization), load_tokenizer(source)


def load_weights_only(
    source: ModelSource, dtype: torch.dtype, device: torch.device, quantization: str | None = None
) -> LlamaForCausalLM:
    """The model alone. Under tensor parallelism (kvserve.distributed.parallel_state set up
    first) it holds this rank's shard: safetensors are read slice by slice, GGUF tensors are
    split after reading."""
    if source.kind == "hf":
        from kvserve.model.loader.hf_loader import hf_arch, hf_weights

        arch = hf_arch(source.path)
        model = _empty_model(arch, dtype)
        weights = hf_weights(source.path, model.weight_slice, model.owns)
    else:
        from kvserve.model.loader.gguf_loader import gguf_arch, gguf_weights

        reader = gguf_reader(source.path)
        arch = gguf_arch(reader)
        model = _empty_model(arch, dtype)
        weights = gguf_weights(reader, arch, quantization)
    model.quantization, model.quant_device = quantization, device
    model.load_weights(weights)
    if source.kind != "hf":
        release_gguf_reader(source.path)
    return model.to(device).eval()


def _empty_model(arch: ModelArch, dtype: torch.dtype) -> LlamaForCausalLM:
    import torch

    from kvserve.model.layers.rotary import RotaryEmbedding
    from kvserve.model.models.llama import LlamaForCausalLM

    with torch.device("meta"):  # no memory until the real weights arrive
        model = LlamaForCausalLM(arch)
    _materialize(model, dtype)
    model.rotary = RotaryEmbedding(
        arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
    )  # float32 tables, whatever the weights' dtype
    return model


def _materialize(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give every meta parameter and buffer uninitialized CPU storage, floats in `dtype`.

    What `to_empty(device="cpu").to(dtype)` does, but with plain `torch.empty` by shape: the
    former goes through torch's meta reference kernels, whose first use imports sympy and
    costs seconds in every engine process. Shared tensors (tied weights) stay shared.
    """
    import torch

    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            kind = dtype if t.is_floating_point() else t.dtype
            made[id(t)] = torch.empty(t.shape, dtype=kind, device="cpu")
        return made[id(t)]

    params: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in params:
                    params[id(p)] = torch.nn.Parameter(empty(p), requires_grad=p.requires_grad)
                module._parameters[name] = params[id(p)]
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = empty(b)
