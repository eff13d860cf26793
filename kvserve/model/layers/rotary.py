"""Rotary position embeddings (rotate-half layout, as in Hugging Face checkpoints).

cos/sin tables are built once for every position up to max_position_embeddings and indexed
by each step's flat position tensor, so no per-layer work depends on the batch layout.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvserve.model.layers.yarn import yarn_attention_factor, yarn_inv_freq


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any], max_positions: int) -> torch.Tensor:
    """Inverse frequencies for 'default', 'linear', 'dynamic', 'yarn' and 'llama3' rope types, and a GGUF
    file's 'freq_factors' (llama.cpp's rope_freqs tensor: llama3 scaling as one divisor a
    dimension)."""
    # float32 like the reference implementation, so positions round the same way.
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "dynamic":
        # transformers' dynamic NTK scaling changes the base only once a sequence outgrows
        # max_position_embeddings, where the engine's context stops; below it, this base (the
        # arithmetic transformers does at that length, which leaves it as it is).
        factor = scaling["factor"]
        base = theta * ((factor * max_positions / max_positions) - (factor - 1)) ** (
            head_dim / (head_dim - 2)
        )
        return 1.0 / (base**exponent)
    if rope_type == "yarn":
        return yarn_inv_freq(head_dim, theta, scaling, max_positions)
    if rope_type == "freq_factors":
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freqs: {factors.numel()} factors for {inv_freq.numel()} frequencies")
        return inv_freq / factors
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(
        f"unsupported rope_type {rope_type!r} (supported: default, linear, dynamic, yarn, llama3)"
    )


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE to flat [num_tokens, heads, head_dim] query/key tensors."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any]) -> None:
        super().__init__()
        # Always computed on the CPU: under the loader's meta-device context these few ops would
        # go through torch's reference implementations, whose first import costs seconds.
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(head_dim, theta, scaling, max_positions).float()
            t = torch.arange(max_positions, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq)
            emb = torch.cat([freqs, freqs], dim=-1)
            cos, sin = emb.cos(), emb.sin()
            if scaling.get("rope_type") == "yarn":  # float32, as transformers scales them
                factor = yarn_attention_factor(scaling, max_positions)
                cos, sin = cos * factor, sin * factor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for this step's positions, shaped to broadcast over heads."""
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        if dtype != cos.dtype:  # (a float32 model's step skips two dispatches)
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin for x of shape [tokens, heads, head_dim]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
