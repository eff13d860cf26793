"""A GGUF tensor as a float32 torch tensor, the simplest block formats (Q4_0, Q4_1, Q8_0)
dequantized with torch's vectorised ops.

gguf's own dequantizer runs numpy over groups of 16 rows: for the default model's 210 Q4_1
tensors it took 1.4 s of a float32 engine's start (docs/BENCHMARKS.md, round 52), more than
the rest of the weights' load. These are gguf's operations in gguf's order (each product and
sum rounded in float32), so the bits are the same (tests/test_gguf_dequant.py); every other
format goes through gguf.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType


def _fp16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scale stored at byte `start` of each block, as float32 [blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """A block's 32 4-bit codes: the low nibbles are elements 0-15, the high ones 16-31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float().mul_(_fp16(blocks, 0))


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _nibbles(blocks[:, 4:]).float().mul_(_fp16(blocks, 0)).add_(_fp16(blocks, 2))


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(_fp16(blocks, 0))


_BLOCK_FORMATS = {
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q8_0: _q8_0,
}


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """A fresh, writable float32 tensor of the tensor's logical shape (`data` is the reader's
    read-only view of the file)."""
    blocks_of = _BLOCK_FORMATS.get(qtype)
    if blocks_of is None:
        from gguf.quants import dequantize as gguf_dequantize

        return torch.from_numpy(np.array(gguf_dequantize(data, qtype), dtype=np.float32))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = torch.from_numpy(np.array(data, dtype=np.uint8)).reshape(-1, type_size)
    shape = (*data.shape[:-1], data.shape[-1] // type_size * block_size)
    return blocks_of(raw).reshape(shape)
