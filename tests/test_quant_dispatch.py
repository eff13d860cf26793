"""Per-row-count kernel dispatch of QuantizedLinear on CPU where kvserve's native kernels are
not built (layers/quant_batched.py; forced here with KVSERVE_DISABLE_CPU_KERNELS, the native
kernels are tests/test_quant_native.py's): each path agrees with x @ W_q.T at the row counts
it serves, int8 keeps exact weight-only arithmetic (widened to bf16 only where the CPU has
native bf16), int4 runs aten's kernel (the dynamic int8 path is off), and without the
quantized engine the weight-only kernels run everywhere."""

from __future__ import annotations

import sys

import pytest
import torch

from kvserve.model.layers import quantized_linear as ql
from kvserve.model.layers.quant_batched import (
    INT4_DYNAMIC_MIN_ROWS,
    INT8_BF16_MIN_ROWS,
    INT8_BF16_MIN_ROWS_LARGE,
    dynamic_int8_mm,
    dynamic_int8_pack,
    int8_bf16_mm,
)
from kvserve.model.layers.quantization import quantize_weight
from kvserve.model.layers.quantized_linear import QuantizedLinear
from kvserve.platform.cpu_isa import cpu_isa

# The bf16 widening runs only with native bf16, and only while it is switched on.
WIDEN = cpu_isa().native_bf16 and INT8_BF16_MIN_ROWS is not None


@pytest.fixture(autouse=True)
def _aten_fallback(monkeypatch):
    monkeypatch.setenv("KVSERVE_DISABLE_CPU_KERNELS", "1")


def _case(method: str, rows: int):
    torch.manual_seed(0)
    qw = quantize_weight(torch.randn(192, 128) * 0.1, method)
    x = torch.randn(rows, 128)
    return qw, x, x @ qw.dequantize().t()


def _close(y: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert (y - ref).abs().max() <= tol * ref.abs().max()


def _spy(monkeypatch, name: str) -> list:
    calls: list = []
    real = getattr(ql, name)
    monkeypatch.setattr(ql, name, lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("rows", [1, 31, 32, 100])
def test_int8_paths_by_rows(rows, monkeypatch):
    """Below bf16_min_rows the weight-only kernel, from there codes widened to bf16: both
    weight-only arithmetic (bf16 activations), no activation quantization."""
    qw, x, ref = _case("int8", rows)
    layer = QuantizedLinear(qw, "cpu")
    assert layer.bf16_min_rows == (INT8_BF16_MIN_ROWS if WIDEN else sys.maxsize)
    assert layer.dynamic is None and layer.duplicate_bytes() == 0
    widened = _spy(monkeypatch, "int8_bf16_mm")
    _close(layer(x), ref, 0.01)
    assert bool(widened) == (rows >= layer.bf16_min_rows)
    ids = torch.tensor([0, 5, 191])
    torch.testing.assert_close(layer.embedding(ids, torch.float32), qw.dequantize()[ids])


def test_int8_vocabulary_table_widens_later():
    qw = quantize_weight(torch.randn(16384, 576) * 0.1, "int8")
    assert QuantizedLinear(qw, "cpu").bf16_min_rows == (INT8_BF16_MIN_ROWS_LARGE if WIDEN else sys.maxsize)


def test_int8_bf16_widening_is_weight_only_arithmetic():
    qw, x, ref = _case("int8", 40)
    _close(int8_bf16_mm(x, qw.codes, qw.scales), ref, 0.01)


def test_int8_never_widens_without_native_bf16(monkeypatch):
    from kvserve.platform.cpu_isa import CpuIsa

    monkeypatch.setattr(ql, "cpu_isa", lambda: CpuIsa(frozenset({"avx2", "fma"})))
    qw, x, ref = _case("int8", 100)
    layer = QuantizedLinear(qw, "cpu")
    widened = _spy(monkeypatch, "int8_bf16_mm")
    _close(layer(x), ref, 0.01)
    assert layer.bf16_min_rows == sys.maxsize and not widened


@pytest.mark.parametrize("rows", [1, 2, 48])
def test_int4_paths_by_rows(rows, monkeypatch):
    qw, x, ref = _case("int4", rows)
    layer = QuantizedLinear(qw, "cpu")
    dynamic = _spy(monkeypatch, "dynamic_int8_mm")
    # The int8 copy re-rounds the int4 values (half an int8 step) and quantizes activations.
    _close(layer(x), ref, 0.03)
    assert bool(dynamic) == (layer.dynamic is not None and rows >= (INT4_DYNAMIC_MIN_ROWS or 0))
    if layer.dynamic is not None:
        assert layer.duplicate_bytes() == 192 * (128 + 4) and "linear_dynamic" in layer.kernel_name()


def test_dynamic_kernel_scales_rows():
    """The dynamic int8 kernel (benchmarked, off by default): a huge first row (as a chunk's
    first token has) must not cost the others precision."""
    qw, x, _ = _case("int8", 8)
    packed = dynamic_int8_pack(qw.codes, qw.scales)
    if packed is None:
        pytest.skip("no quantized engine in this PyTorch")
    x[0] *= 1000
    ref = x @ qw.dequantize().t()
    y = dynamic_int8_mm(x, packed)
    for r in range(1, 8):
        _close(y[r : r + 1], ref[r : r + 1], 0.03)


def test_without_quantized_engine_int4_weight_only(monkeypatch):
    monkeypatch.setattr(ql, "dynamic_int8_pack", lambda *a: None)
    for rows in (1, 64):
        qw, x, ref = _case("int4", rows)
        layer = QuantizedLinear(qw, "cpu")
        assert layer.dynamic is None and layer.duplicate_bytes() == 0
        _close(layer(x), ref, 0.01)
        assert "pack_mm" in layer.kernel_name() or "native" in layer.kernel_name()
