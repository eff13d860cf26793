"""YaRN rotary scaling (Qwen2.5's long-context configs), computed as transformers computes it:
the frequencies blended between interpolated and extrapolated across a ramp of dimensions, and
cos / sin scaled by an attention factor. It is static (no length-dependent update), so a
paged cache holds keys rotated exactly as transformers rotates them."""

from __future__ import annotations

import math
from typing import Any

import torch


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(scaling: dict[str, Any], max_positions: int) -> float:
    """The factor cos and sin are multiplied by."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = yarn_factor(scaling, max_positions)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_mscale(factor, mscale) / _mscale(factor, mscale_all_dim))
    return _mscale(factor)


def yarn_factor(scaling: dict[str, Any], max_positions: int) -> float:
    """The context's scale: `factor`, or max_position_embeddings over the original length."""
    factor = scaling.get("factor")
    return max_positions / scaling["original_max_position_embeddings"] if factor is None else factor


def yarn_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any], max_positions: int) -> torch.Tensor:
    """Inverse frequencies: extrapolated (unscaled) for the fast dimensions, interpolated (divided
    by the factor) for the slow ones, linearly blended between beta_fast and beta_slow rotations
    over the original context."""
    factor = yarn_factor(scaling, max_positions)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the share of each dimension left unscaled
    return interpolated * (1 - keep) + extrapolated * keep
