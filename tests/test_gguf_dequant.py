"""kvserve's torch dequantizer for GGUF's block formats gives gguf's own bits: weights
quantized by gguf at several magnitudes, and raw blocks of random codes under random finite
scales (every code and sign), in the reader's row shapes; other formats go through gguf."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize

from kvserve.model.loader.gguf_dequant import dequantize

FORMATS = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]


def _same_bits(data: np.ndarray, qtype: GGMLQuantizationType) -> None:
    want = torch.from_numpy(np.array(gguf_dequantize(data, qtype), dtype=np.float32))
    got = dequantize(data, qtype)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), qtype.name


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_quantized_weights_dequantize_to_ggufs_bits(qtype):
    rng = np.random.default_rng(0)
    for scale in (1e-3, 0.02, 1.0, 300.0):
        weights = (rng.standard_normal((48, 256)) * scale).astype(np.float32)
        weights[0, :32] = 0.0  # an all-zero block: a zero scale
        data = quantize(weights, qtype)
        data.setflags(write=False)  # as the reader maps the file
        _same_bits(data, qtype)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_random_blocks_dequantize_to_ggufs_bits(qtype):
    from gguf import GGML_QUANT_SIZES

    _, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(2000, type_size), dtype=np.uint8)
    scales = 2 if qtype != GGMLQuantizationType.Q4_1 else 4  # Q4_1: a scale and a minimum
    finite = rng.uniform(-60000, 60000, size=(2000, scales // 2)).astype(np.float16)
    blocks[:, :scales] = finite.view(np.uint8)
    _same_bits(blocks.reshape(40, -1), qtype)


def test_other_formats_go_through_gguf():
    weights = np.random.default_rng(2).standard_normal((4, 256)).astype(np.float32)
    half = weights.astype(np.float16)
    got = dequantize(half, GGMLQuantizationType.F16)
    assert torch.equal(got, torch.from_numpy(half.astype(np.float32)))
    got[0, 0] = 1.0  # writable, and a copy: the file's mapping is read-only
    data = quantize(weights, GGMLQuantizationType.Q5_0)
    assert torch.equal(
        dequantize(data, GGMLQuantizationType.Q5_0),
        torch.from_numpy(gguf_dequantize(data, GGMLQuantizationType.Q5_0)),
    )
