"""GGUF quantized tensors loaded straight into kvserve's int4 format, where one matches.

Q4_0, Q4_1 and Q4_K store 4-bit codes with a scale (and a minimum) per 32 weights of a row,
which is exactly kvserve's int4 layout: the codes are kept as they are, and only the
per-group scale and zero point are rounded from float16 to bfloat16 (the CPU kernel's
type). Every other pairing goes through float once (dequantize, then quantize):
- Q8_0 has a scale per 32 weights; the int8 kernel wants one per row, so it is re-quantized;
- Q6_K has 6-bit codes, which do not fit int4 and have per-16 scales (not int8's per row);
- any GGUF type to fp8, and Q4_x to int8 (int8 per row cannot hold per-group scales).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import Q4_K

from kvserve.model.layers.quantization import INT4_GROUP_SIZE, SCALE_DTYPE, QWeight

DIRECT = {
    "int4": (T.Q4_0, T.Q4_1, T.Q4_K),
}


def _f16(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: low nibbles are elements 0-15, high ones 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def gguf_qweight(data: np.ndarray, qtype: T, method: str) -> QWeight | None:
    """The tensor's rows ([out_features, row bytes] uint8) as a QWeight, or None when
    `qtype` has no direct mapping to `method` (the caller then dequantizes)."""
    if qtype not in DIRECT.get(method, ()):
        return None
    rows = data.shape[0]
    if qtype == T.Q4_K:
        blocks = data.reshape(-1, 144)  # d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 bytes
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mn = Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [blocks, 8] each
        qs = blocks[:, 16:].reshape(-1, 4, 32)  # chunk j: low nibbles = subblock 2j, high = 2j + 1
        codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
        scale = d * sc.astype(np.float32)  # [blocks, 8]
        low = -dmin * mn.astype(np.float32)  # w = scale * q + low
    else:
        size = 18 if qtype == T.Q4_0 else 20
        blocks = data.reshape(-1, size)
        scale = _f16(blocks[:, 0:2])[:, 0]
        low = -8 * scale if qtype == T.Q4_0 else _f16(blocks[:, 2:4])[:, 0]
        codes = _nibbles(blocks[:, size - 16 :])
    # w = scale * q + low = (q - 8) * scale + (low + 8 * scale)
    scales = torch.from_numpy(np.ascontiguousarray(scale.reshape(rows, -1))).to(SCALE_DTYPE)
    zeros = torch.from_numpy(np.ascontiguousarray((low + 8 * scale).reshape(rows, -1))).to(SCALE_DTYPE)
    codes_t = torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, -1)))
    return QWeight("int4", codes_t, scales, zeros, INT4_GROUP_SIZE)
