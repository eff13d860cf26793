"""Model loading: resolve the source, build the model, fill its weights, get a tokenizer."""

from __future__ import annotations

import torch

from kvserve.model.layers.rotary import RotaryEmbedding
from kvserve.model.loader.resolve import ModelSource, resolve_model
from kvserve.model.models.llama import LlamaForCausalLM
from kvserve.tokenizer import Tokenizer

__all__ = ["load_model", "load_tokenizer", "resolve_model", "ModelSource"]


def load_tokenizer(source: ModelSource) -> Tokenizer:
    """Only the tokenizer (what the API server process needs)."""
    if source.kind == "hf":
        from kvserve.model.loader.hf_loader import hf_tokenizer

        return Tokenizer(hf_tokenizer(source.path))
    import gguf

    from kvserve.model.loader.gguf_loader import gguf_tokenizer

    return Tokenizer(*gguf_tokenizer(gguf.GGUFReader(source.path)))


def load_model(
    source: ModelSource, dtype: torch.dtype, device: torch.device, quantization: str | None = None
) -> tuple[LlamaForCausalLM, Tokenizer]:
    """The model on `device` and its tokenizer; `quantization` (int8 | int4 | fp8) quantizes the
    projections while loading (GGUF tensors with a matching format are taken as they are)."""
    if source.kind == "hf":
        from kvserve.model.loader.hf_loader import hf_arch, hf_tokenizer, hf_weights

        arch = hf_arch(source.path)
        weights = hf_weights(source.path)
        tokenizer = Tokenizer(hf_tokenizer(source.path))
    else:
        import gguf

        from kvserve.model.loader.gguf_loader import gguf_arch, gguf_tokenizer, gguf_weights

        reader = gguf.GGUFReader(source.path)
        arch = gguf_arch(reader)
        weights = gguf_weights(reader, arch, quantization)
        tokenizer = Tokenizer(*gguf_tokenizer(reader))
    with torch.device("meta"):  # no memory until the real weights arrive
        model = LlamaForCausalLM(arch)
    model = model.to_empty(device="cpu").to(dtype)
    model.rotary = RotaryEmbedding(
        arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
    )  # float32 tables, whatever the weights' dtype
    model.quantization, model.quant_device = quantization, device
    model.load_weights(weights)
    return model.to(device).eval(), tokenizer
