"""Load a Llama-family GGUF file: architecture, dequantized weights, tokenizer.

Weights are dequantized with the `gguf` package, except tensors whose GGUF format maps
directly to the requested `--quantization` (gguf_quants.py), which keep their codes.
llama.cpp's converter permutes the rows of Q and K of a `llama` file (Mistral's too) for its
interleaved rotary layout; we undo that (on floats or codes alike) so the model sees Hugging
Face layout. A `qwen2` file is not permuted: llama.cpp runs it with NEOX (rotate-half) rotary
on Hugging Face's own rows, as transformers' GGUF loader reads it. The tokenizer
is tokenizer_loader.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from kvserve.model.arch import SUPPORTED_ARCHITECTURES, ModelArch
from kvserve.model.layers.quantization import QWeight
from kvserve.model.loader.gguf_dequant import dequantize
from kvserve.model.loader.gguf_file import gguf_field
from kvserve.model.loader.gguf_quants import gguf_qweight

_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


# Tensors outside the layers that a file may hold: rope_freqs is read by gguf_arch (llama3 scaling).
_TOP_LEVEL = ("token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight")


def tensors_not_run(names: set[str], blocks: int) -> list[str]:
    """The file's tensors this model has no place for (a Mixtral file's router and experts,
    another model's norms, a block past block_count): skipped, they ran the model without
    them. llama.cpp refuses a file whose tensor count its graph does not account for."""
    out = []
    for name in sorted(names):
        parts = name.split(".")
        if parts[0] == "blk":
            in_range = parts[1].isdigit() and int(parts[1]) < blocks
            if len(parts) != 4 or parts[2] not in _TENSOR_NAMES or not in_range:
                out.append(name)
        elif name not in _TOP_LEVEL:
            out.append(name)
    return out


# The GGUF architectures whose Q / K rows llama.cpp's converter permutes (LlamaModel.permute).
_PERMUTED_QK = ("llama",)


def _unpermute(w, n_heads: int):
    """Inverse of llama.cpp's rotary row permutation for Q/K weights (and biases); numpy or torch."""
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def rope_scaling_of(get: Callable[..., Any], freq_factors: np.ndarray | None) -> dict[str, Any]:
    """The rotary scaling as llama.cpp reads a file's: the type defaults to linear, its factor
    is rope.scaling.factor or the old converters' rope.scale_linear, and a factor of 0 or none
    at all is 1.0 (no scaling); type none never scales. A linear file without a factor was a
    TypeError at load, and an old file's scale_linear ran unscaled."""
    kind = get("rope.scaling.type") or "linear"
    if kind not in ("none", "linear"):
        # yarn, longrope: they ran unscaled. (llama.cpp's yarn is not transformers' to the bit.)
        raise ValueError(f"unsupported rope_type {kind!r} in a GGUF file (supported: none, linear)")
    factor = float(get("rope.scaling.factor") or get("rope.scale_linear") or 0.0)
    if kind == "none" or factor == 0.0:
        factor = 1.0
    if freq_factors is not None:
        # llama.cpp writes a Llama 3.1+ model's llama3 rope scaling as this per-dimension
        # divisor of the inverse frequencies; without it every position rotated unscaled.
        # (llama.cpp divides by a linear factor as well.)
        return {"rope_type": "freq_factors", "factors": [float(x) * factor for x in freq_factors]}
    return {"rope_type": "default"} if factor == 1.0 else {"rope_type": "linear", "factor": factor}


def gguf_arch(reader) -> ModelArch:
    arch = gguf_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"model: GGUF architecture {arch!r} is not supported ({SUPPORTED_ARCHITECTURES})")

    def get(key: str, default=None):
        return gguf_field(reader, f"{arch}.{key}", default)

    def need(key: str):
        """A key the model's shape needs (llama.cpp refuses a file without it): its absence was
        a TypeError (int(None)), or for context_length / rms epsilon a guess (2048 / 1e-6)."""
        value = get(key)
        if value is None:
            raise ValueError(f"model: GGUF without {arch}.{key}")
        return value

    heads = need("attention.head_count")
    hidden = need("embedding_length")
    names = {t.name for t in reader.tensors}
    experts = get("expert_count")
    if experts:
        raise ValueError(
            f"model: a mixture-of-experts GGUF ({arch}.expert_count = {experts}) is not supported"
        )
    unknown = tensors_not_run(names, int(need("block_count")))
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise ValueError(f"model: GGUF tensors kvserve does not run: {', '.join(unknown[:5])}{more}")
    vocab = get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    head_dim = int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads)
    rotary = int(get("rope.dimension_count") or head_dim)
    if rotary != head_dim:
        # Every dimension rotated: other tokens than the file's model (llama.cpp refuses a
        # llama file's and rotates only these in a qwen2 file's).
        raise ValueError(
            f"model: GGUF rotary over {rotary} of each head's {head_dim} dimensions "
            f"({arch}.rope.dimension_count) is not supported"
        )
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    scaling = rope_scaling_of(get, None if freqs is None else np.asarray(freqs.data).ravel())
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    eot = gguf_field(reader, "tokenizer.ggml.eot_token_id")
    return ModelArch(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=int(heads),
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        # llama.cpp's llama graph adds an output and MLP bias where the file holds them (a
        # Llama with attention_bias / mlp_bias): refused as tensors the model did not use.
        o_proj_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_gate.bias" in names,
        rope_scaling=scaling,
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(t) for t in (eos, eot) if t is not None)),
    )


def gguf_weights(
    reader, arch: ModelArch, quantization: str | None = None
) -> Iterator[tuple[str, torch.Tensor | QWeight]]:
    """Yield (Hugging Face name, float32 tensor or, for layer projections that map directly
    to `quantization`, QWeight) pairs."""
    for t in reader.tensors:
        parts = t.name.split(".")
        direct = None
        if quantization and parts[0] == "blk" and len(t.data.shape) == 2:
            direct = gguf_qweight(t.data, t.tensor_type, quantization)
        w = direct if direct is not None else dequantize(t.data, t.tensor_type)
        if parts[0] == "blk":
            kind, suffix = parts[2], parts[3]
            heads = {"attn_q": arch.num_heads, "attn_k": arch.num_kv_heads}.get(kind)
            if arch.architecture not in _PERMUTED_QK:
                heads = None  # qwen2: Hugging Face's rows as they are
            if heads and direct is not None:
                w = direct.map_rows(lambda a, h=heads: _unpermute(a, h))
            elif heads:
                w = _unpermute(w, heads)
            if kind not in _TENSOR_NAMES:
                continue  # (gguf_arch refused the file)
            name = f"model.layers.{parts[1]}.{_TENSOR_NAMES[kind]}.{suffix}"
        elif t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        else:
            continue
        if direct is not None:
            yield name, w
        else:
            yield name, w
