"""kvserve's native int4 kernel (csrc/quant_matmul_cpu.cpp) against the float reference: every
ISA variant this CPU can run plus the plain C++ fallback, both arithmetics, odd shapes and
row counts; the AVX-512 variant at least compiles everywhere; QuantizedLinear keeps the
weight once in the kernel's layout; and greedy decoding through it matches the dequantized
float model up to the quantized near-tie rule. No timing here (benchmarks/bench_quant_native.py).
The first run builds each variant (about a minute each on 2 cores); later runs use the cache."""

from __future__ import annotations

import pytest
import torch
from helpers import QUANTIZED_TIE, assert_quantized_match

from kvserve import LLM, SamplingParams
from kvserve.model.layers import quant_kernels as qk
from kvserve.model.layers import quantized_linear as ql
from kvserve.model.layers.quantization import quantize_weight

pytestmark = pytest.mark.skipif(qk.load_quant_kernels("generic") is None, reason="no C++ toolchain here")

VARIANTS = qk.runnable_variants()
TOL = {qk.MODE_WEIGHT_ONLY: 1e-5, qk.MODE_INT8_ACTS: 0.02}  # of the output's largest magnitude


def _case(n: int, k: int, rows: int):
    torch.manual_seed(n * 1000 + k + rows)
    qw = quantize_weight(torch.randn(n, k) * 0.1, "int4")
    x = torch.randn(rows, k)
    return qw, x, x @ qw.dequantize().t()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("mode", [qk.MODE_WEIGHT_ONLY, qk.MODE_INT8_ACTS])
def test_kernel_matches_float_reference(variant, mode):
    mod = qk.load_quant_kernels(variant)
    assert mod is not None and mod.isa() == variant
    for n, k in [(33, 96), (192, 128), (50, 1536)]:
        for rows in (1, 3, 6, 17, 21, 64):  # 17, 21: the 8-row tiles' remainders
            qw, x, ref = _case(n, k, rows)
            codes, sz = qk.pack_int4(qw.codes, qw.scales, qw.zeros)
            y = mod.int4_mm(x, codes, sz, mode)
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            assert err <= TOL[mode], (variant, mode, n, k, rows, err)


@pytest.mark.parametrize("variant", VARIANTS)
def test_int8_kernel_matches_float_reference(variant):
    mod = qk.load_quant_kernels(variant)
    for n, k in [(33, 96), (50, 1544)]:
        for rows in (1, 3, 6, 17, 21, 64):
            torch.manual_seed(rows)
            qw = quantize_weight(torch.randn(n, k) * 0.1, "int8")
            x = torch.randn(rows, k)
            ref = x @ qw.dequantize().t()
            err = ((mod.int8_mm(x, qw.codes, qw.scales) - ref).abs().max() / ref.abs().max()).item()
            assert err <= 1e-5, (variant, n, k, rows, err)


def test_quantized_linear_int8_native_keeps_lookups():
    torch.manual_seed(0)
    qw = quantize_weight(torch.randn(64, 96) * 0.1, "int8")
    layer = ql.QuantizedLinear(qw, "cpu")
    assert layer.native == VARIANTS[0] and "int8: kvserve native" in layer.kernel_name()
    x = torch.randn(9, 96)
    torch.testing.assert_close(layer(x), x @ qw.dequantize().t(), rtol=1e-5, atol=1e-5)
    ids = torch.tensor([0, 7, 63])
    torch.testing.assert_close(layer.embedding(ids, torch.float32), qw.dequantize()[ids])


def test_variants_agree_on_int8_activations():
    """Same quantized activations, integer dot products: variants differ only in fp32 sums."""
    qw, x, _ = _case(64, 576, 5)
    codes, sz = qk.pack_int4(qw.codes, qw.scales, qw.zeros)
    ys = [qk.load_quant_kernels(v).int4_mm(x, codes, sz, qk.MODE_INT8_ACTS) for v in VARIANTS]
    for y in ys[1:]:
        torch.testing.assert_close(y, ys[0], rtol=1e-4, atol=1e-4)


def test_avx512_variant_compiles_and_is_never_loaded_where_it_cannot_run():
    assert qk.compile_only("avx512_vnni").endswith(".o")
    if "avx512_vnni" not in VARIANTS:
        assert qk.load_quant_kernels("avx512_vnni") is None


def test_pack_layout_round_trips():
    qw, _, _ = _case(48, 96, 1)
    codes, sz = qk.pack_int4(qw.codes, qw.scales, qw.zeros)
    assert codes.shape == (48, 48) and sz.shape == (48, 3, 2) and sz.dtype == torch.bfloat16
    torch.testing.assert_close(qk.unpack_int4(codes, sz), qw.dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("forced", ["generic", None])
def test_quantized_linear_runs_native_held_once(forced, monkeypatch):
    if forced:
        monkeypatch.setenv("KVSERVE_QUANT_ISA", forced)
    layer_variant = forced or VARIANTS[0]
    for rows in (1, ql.NATIVE_WEIGHT_ONLY_MIN_ROWS - 1, ql.NATIVE_WEIGHT_ONLY_MIN_ROWS, 40):
        qw, x, ref = _case(96, 192, rows)
        layer = ql.QuantizedLinear(qw, "cpu")
        assert layer.native == layer_variant and f"native C++ ({layer_variant})" in layer.kernel_name()
        # One copy, as many bytes as aten's layout: N*K/2 codes + bf16 scale and zero per group.
        held = sum(b.numel() * b.element_size() for b in layer.buffers())
        assert held == 96 * 192 // 2 + 96 * (192 // 32) * 2 * 2 and layer.duplicate_bytes() == 0
        torch.testing.assert_close(layer.dequantize(), qw.dequantize())
        tol = TOL[qk.MODE_WEIGHT_ONLY if rows >= ql.NATIVE_WEIGHT_ONLY_MIN_ROWS else qk.MODE_INT8_ACTS]
        assert (layer(x) - ref).abs().max() <= max(tol, 1e-4) * ref.abs().max()


def test_disabled_falls_back_to_aten(monkeypatch):
    monkeypatch.setenv("KVSERVE_DISABLE_CPU_KERNELS", "1")
    qw, x, ref = _case(96, 192, 3)
    layer = ql.QuantizedLinear(qw, "cpu")
    assert layer.native is None and "pack_mm" in layer.kernel_name()
    assert (layer(x) - ref).abs().max() <= 0.01 * ref.abs().max()


def _float_forward(self, x, bias=None):
    """The dequantized weight in fp32: the reference the native path should reproduce."""
    y = x.float() @ self.dequantize(torch.float32).t()
    y = y.to(x.dtype)
    return y if bias is None else y + bias


def test_greedy_native_int4_matches_dequantized_float(tiny_llama_dir, monkeypatch):
    prompts = ["Hello world", "The quick brown fox", "1 2 3 4"]
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2)
    native = LLM(tiny_llama_dir, kv_cache_memory="1MiB", quantization="int4")
    model = native.llm_engine.model_runner.model
    assert any(m.native for m in model.modules() if isinstance(m, ql.QuantizedLinear))
    got = native.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(ql.QuantizedLinear, "forward", _float_forward)
    base = native.generate(prompts, params, use_tqdm=False)  # same weights, float arithmetic
    for p, b, g in zip(prompts, base, got, strict=True):
        assert_quantized_match(b.outputs[0], g.outputs[0].token_ids, f"native int4 {p!r}")


@pytest.mark.slow
def test_int4_request_alone_and_in_a_batch_of_eight_decode_alike():
    """A request decoded alone runs int8 activations (below NATIVE_WEIGHT_ONLY_MIN_ROWS rows);
    in a batch of eight it runs weight-only. The two arithmetics must not change its greedy
    tokens beyond a tie of the quantized model itself (default model, its own Q4_1 weights)."""
    llm = LLM("smollm2-135m", kv_cache_memory="64MiB", quantization="int4")
    assert ql.NATIVE_WEIGHT_ONLY_MIN_ROWS <= 8
    tok = llm.tokenizer
    texts = [f"Question {i}: name a reason people like {w}." for i, w in enumerate(
        ["tea", "rain", "maps", "music", "trains", "books", "cats", "winter"])]  # fmt: skip
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    together = llm.generate(prompts, params, use_tqdm=False)
    pairs = [(llm.generate([t], params, use_tqdm=False)[0].outputs[0], b.outputs[0])
             for t, b in zip(prompts[:3], together[:3])]  # fmt: skip
    # How far the two arithmetics put the same token's logprob apart while they agree (int8
    # activations round each group of 32 inputs). A flip of the top two needs their difference
    # to move, which each arithmetic's error can do by up to twice this noise.
    noise = max(
        abs(alone.logprobs[k][tok] - batched.logprobs[k][tok])
        for alone, batched in pairs
        for k, tok in enumerate(alone.token_ids)
        if batched.token_ids[: k + 1] == alone.token_ids[: k + 1]
    )
    print(f"int4 alone vs batch: logprob noise on agreed tokens {noise:.3g}")
    assert noise < 0.25, f"the two arithmetics disagree by {noise:.3g} nats on agreed tokens"
    for p, (alone, batched) in zip(texts, pairs):
        assert_quantized_match(
            alone, batched.token_ids, f"int4 alone vs batch {p!r}", max(QUANTIZED_TIE, 2 * noise)
        )
