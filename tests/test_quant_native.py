"""kvserve's native int4 kernel (csrc/quant_matmul_cpu.cpp) against the float reference: every
ISA variant this CPU can run plus the plain C++ fallback, odd shapes (partial panels) and row
counts; a row's output is bit-identical alone and in any batch; the AVX-512 variant at least
compiles everywhere; QuantizedLinear keeps the weight once in the kernel's layout; and greedy
decoding through it matches the dequantized float model up to the quantized near-tie rule.
No timing here (benchmarks/bench_quant_native.py). The first run builds each variant (about a
minute each on 2 cores); later runs use the cache."""

from __future__ import annotations

import ctypes

import pytest
import torch
from helpers import QUANTIZED_TIE, agreed_logprob_noise, assert_quantized_match

from kvserve import LLM, SamplingParams
from kvserve.model.layers import quant_kernels as qk
from kvserve.model.layers import quantized_linear as ql
from kvserve.model.layers.quantization import quantize_weight

pytestmark = pytest.mark.skipif(qk.load_quant_kernels("generic") is None, reason="no C++ toolchain here")

VARIANTS = qk.runnable_variants()
TOL = 0.02  # of the output's largest magnitude: int8 activations round each group of 32 inputs


def _case(n: int, k: int, rows: int):
    torch.manual_seed(n * 1000 + k + rows)
    qw = quantize_weight(torch.randn(n, k) * 0.1, "int4")
    x = torch.randn(rows, k)
    return qw, x, x @ qw.dequantize().t()


def _check_against_reference(mm, weight: tuple, x, ref, label) -> None:
    """mm(x, *weight) is within TOL of the float reference, and each row alone gives the same
    bits as in the batch: one output is one SIMD lane whatever the row count."""
    y = mm(x, *weight)
    err = ((y - ref).abs().max() / ref.abs().max()).item()
    assert err <= TOL, (*label, err)
    rows = x.shape[0]
    for r in {0, rows // 2, rows - 1}:
        assert torch.equal(mm(x[r : r + 1].contiguous(), *weight)[0], y[r]), (*label, r)


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_matches_float_reference_and_rows_alone(variant):
    mod = qk.load_quant_kernels(variant)
    assert mod is not None and mod.isa() == variant
    for n, k in [(33, 96), (192, 128), (50, 1536), (7, 64)]:  # 33, 50, 7: a partial last panel
        for rows in (1, 3, 6, 7, 9, 17, 21, 64):  # 6, 7, 9, 17, 21: the tiles' remainders
            qw, x, ref = _case(n, k, rows)
            codes, sz = qk.pack_int4(qw.codes, qw.scales, qw.zeros)
            _check_against_reference(mod.int4_mm, (codes, sz, n), x, ref, (variant, n, k, rows))


@pytest.mark.parametrize("variant", VARIANTS)
def test_panels_split_over_threads_give_the_same_bits(variant):
    """A call's panels split between two threads give one thread's bits: one output is one
    lane of the same kernel, whichever thread computes it."""
    mod = qk.load_quant_kernels(variant)
    qw, _, _ = _case(1000, 96, 1)  # 63 panels
    codes, sz = qk.pack_int4(qw.codes, qw.scales, qw.zeros)
    q8 = quantize_weight(torch.randn(1000, 96) * 0.1, "int8")
    codes8, scales8 = qk.pack_int8(q8.codes, q8.scales)
    before = torch.get_num_threads()
    try:
        for rows in (1, 5, 40):  # one row (a GEMV), a tile and a tail, many tiles
            x = torch.randn(rows, 96)
            ys = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                ys.append((mod.int4_mm(x, codes, sz, 1000), mod.int8_mm(x, codes8, scales8, 1000)))
            assert torch.equal(ys[0][0], ys[1][0]) and torch.equal(ys[0][1], ys[1][1]), (variant, rows)
    finally:
        torch.set_num_threads(before)


def test_kernel_rejects_a_row_count_outside_its_panels():
    qw, x, _ = _case(33, 96, 2)
    codes, sz = qk.pack_int4(qw.codes, qw.scales, qw.zeros)
    with pytest.raises(RuntimeError, match="panels of 16 rows"):
        qk.load_quant_kernels("generic").int4_mm(x, codes, sz, 49)


@pytest.mark.parametrize("variant", VARIANTS)
def test_int8_kernel_matches_float_reference_and_rows_alone(variant):
    mod = qk.load_quant_kernels(variant)
    for n, k in [(33, 96), (50, 1536)]:
        for rows in (1, 3, 6, 17, 21, 64):
            torch.manual_seed(rows)
            qw = quantize_weight(torch.randn(n, k) * 0.1, "int8")
            x = torch.randn(rows, k)
            ref = x @ qw.dequantize().t()
            codes, scales = qk.pack_int8(qw.codes, qw.scales)
            _check_against_reference(mod.int8_mm, (codes, scales, n), x, ref, (variant, n, k, rows))


def test_quantized_linear_int8_native_keeps_lookups():
    torch.manual_seed(0)
    qw = quantize_weight(torch.randn(50, 96) * 0.1, "int8")  # 50: a partial last panel
    layer = ql.QuantizedLinear(qw, "cpu")
    assert layer.native == VARIANTS[0] and "int8: kvserve native" in layer.kernel_name()
    x = torch.randn(9, 96)
    ref = x @ qw.dequantize().t()
    assert (layer(x) - ref).abs().max() <= TOL * ref.abs().max()
    ids = torch.tensor([0, 7, 49, 16])
    torch.testing.assert_close(layer.embedding(ids, torch.float32), qw.dequantize()[ids], rtol=0, atol=0)
    torch.testing.assert_close(layer.dequantize(), qw.dequantize(), rtol=0, atol=0)
    bf16 = layer.embedding(ids, torch.bfloat16)  # the torch ops' path, for other dtypes
    torch.testing.assert_close(bf16, qw.dequantize()[ids].bfloat16(), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="token id 64 out of range"):  # past the last panel's padding
        layer.embedding(torch.tensor([3, 64]), torch.float32)


@pytest.mark.skipif("avx2" not in VARIANTS, reason="this CPU cannot run the AVX2 variant")
def test_avx2_int4_unpacked_panels_give_the_same_bits(monkeypatch):
    """The AVX2 int4 tiles of 4+ rows with each panel's codes unpacked once and unpacked per
    tile give the same bits, at tile remainders of 0-3 rows; the form is chosen at load by
    timing both unless KVSERVE_INT4_UNPACKED says, and variants without it report none."""
    mod = qk.load_quant_kernels("avx2")
    qw, x, _ = _case(40, 160, 23)  # 23 rows: five 4-row tiles and 3; 40 outputs: a partial panel
    codes, sz = qk.pack_int4(qw.codes, qw.scales, qw.zeros)
    try:
        for rows in (4, 5, 6, 7, 23):
            xr = x[:rows].contiguous()
            assert mod.set_int4_unpacked(True)
            unpacked = mod.int4_mm(xr, codes, sz, 40)
            assert not mod.set_int4_unpacked(False)
            assert torch.equal(unpacked, mod.int4_mm(xr, codes, sz, 40)), rows
        for forced in ("0", "1"):
            monkeypatch.setenv("KVSERVE_INT4_UNPACKED", forced)
            assert qk.choose_int4_unpacked(mod, "avx2") == (forced == "1")
            assert f"KVSERVE_INT4_UNPACKED={forced}" in qk.INT4_TILES["avx2"]
        monkeypatch.delenv("KVSERVE_INT4_UNPACKED")
        assert qk.int4_unpacked_time_ratio(mod, reps=3) > 0
        on = qk.choose_int4_unpacked(mod, "avx2")
        assert qk.INT4_TILES["avx2"].startswith("unpacked" if on else "packed")
        assert "measured at load" in qk.INT4_TILES["avx2"]
    finally:
        monkeypatch.delenv("KVSERVE_INT4_UNPACKED", raising=False)
        qk.choose_int4_unpacked(mod, "avx2")
    assert not qk.choose_int4_unpacked(qk.load_quant_kernels("generic"), "generic")
    assert "generic" not in qk.INT4_TILES


def test_variants_agree_on_int8_activations():
    """Same quantized activations, integer dot products, the same fp32 steps per output: the
    SIMD variants agree bit for bit; the plain C++ one differs only where the compiler fuses."""
    # 37 rows: two AMX tiles where present, then the VNNI ones; 576 and 160 inputs: 18 and 5
    # groups, so the AMX batches of four groups end in a batch of two and of one. 86 rows and
    # 72 int8 outputs: int8's 2 x 2 blocks (two row tiles x two panels) then an odd row tile,
    # and an odd last panel (a partial one) alone
    for k, rows, n8 in ((576, 37, 40), (160, 37, 40), (576, 86, 72)):
        qw, x, _ = _case(64, k, rows)
        codes, sz = qk.pack_int4(qw.codes, qw.scales, qw.zeros)
        q8 = quantize_weight(torch.randn(n8, k) * 0.1, "int8")
        codes8, scales8 = qk.pack_int8(q8.codes, q8.scales)
        for name, weight in (("int4_mm", (codes, sz, 64)), ("int8_mm", (codes8, scales8, n8))):
            ys = {v: getattr(qk.load_quant_kernels(v), name)(x, *weight) for v in VARIANTS}
            simd = [ys[v] for v in VARIANTS if v != "generic"]
            for y in simd[1:]:
                assert torch.equal(y, simd[0])
            torch.testing.assert_close(ys["generic"], ys[VARIANTS[0]], rtol=1e-4, atol=1e-4)


def _quantize_rows(variant: str, x: torch.Tensor) -> list[torch.Tensor]:
    """The variant's activation quantizer (the address DecodeStack calls) over x's rows: the
    int8 codes, and per group of 32 the scale, scale x code sum and code sum."""
    fn = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 4)(
        qk.load_quant_kernels(variant).matmul_addresses()["quantize_rows"]
    )
    m, k = x.shape
    out = [torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // 32), torch.empty(m, k // 32),
           torch.empty(m, k // 32, dtype=torch.int32)]  # fmt: skip
    fn(x.data_ptr(), m, k, *(t.data_ptr() for t in out))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.is_floating_point() else t  # NaN == NaN, bit for bit


def test_activation_quantizer_is_its_definition_in_every_variant():
    """Per group of 32: d = max|x| / 127, codes = x * (127 / max|x|) rounded half to even (0
    where d is 0), their sum, and d x sum. Every variant gives exactly that, whatever its way
    there (AVX-512 folds up to 16 groups' maxima and sums at once, then takes the rest one at a
    time): group counts below, at and past the fold, an all-zero group and one whose scale is a
    denormal; a group holding an infinity, where no reference is defined, only agrees across
    the SIMD variants."""
    torch.manual_seed(5)
    for k in (32, 160, 576, 704, 1536, 2080):  # 1, 5, 18, 22 (16 + 6), 48 and 65 groups
        x = torch.randn(6, k) * torch.logspace(-30, 4, 6).unsqueeze(1)
        x[0, :32] = 0
        x[1, -32:] = 1e-36  # its scale 1e-36 / 127 a denormal, 127 / 1e-36 still finite
        x[2, -32] = float("inf")
        g = x.view(6, k // 32, 32)
        mx = g.abs().amax(-1)
        d = mx / 127
        inv = torch.where(d > 0, 127 / mx, torch.zeros_like(mx))
        codes = torch.round(g * inv.unsqueeze(-1)).nan_to_num(nan=-128).clamp(-128, 127)
        total = codes.to(torch.int32).sum(-1)
        want = [codes.to(torch.int8).view(6, k), d, d * total.float(), total]
        for variant in VARIANTS:
            got = _quantize_rows(variant, x)
            rows = [0, 1, 3, 4, 5]  # not row 2: its infinite group's codes are integer-indefinite
            for name, a, b in zip(("codes", "d", "s", "sum"), got, want):
                assert torch.equal(_bits(a[rows]), _bits(b[rows])), (variant, k, name)
            if variant != "generic":  # its int cast of the NaN an infinity makes is undefined
                for a, b in zip(got, _quantize_rows(VARIANTS[0], x)):
                    assert torch.equal(_bits(a), _bits(b)), (variant, k)  # all rows: SIMD variants agree


@pytest.mark.parametrize("variant", ["avx512_amx", "avx512_vnni"])
def test_avx512_variants_compile_and_are_never_loaded_where_they_cannot_run(variant):
    assert qk.compile_only(variant).endswith(".o")
    if variant not in VARIANTS:
        assert qk.load_quant_kernels(variant) is None


def test_pack_layout_round_trips():
    for n in (48, 33):  # 33: the last panel padded
        qw, _, _ = _case(n, 96, 1)
        codes, sz = qk.pack_int4(qw.codes, qw.scales, qw.zeros)
        panels = -(-n // 16)
        assert codes.shape == (panels, 12, 64) and sz.shape == (panels, 3, 2, 16)
        assert sz.dtype == torch.bfloat16
        torch.testing.assert_close(qk.unpack_int4(codes, sz, n), qw.dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("forced", ["generic", None])
def test_quantized_linear_runs_native_held_once(forced, monkeypatch):
    if forced:
        monkeypatch.setenv("KVSERVE_QUANT_ISA", forced)
    layer_variant = forced or VARIANTS[0]
    for rows in (1, 5, 6, 40):
        qw, x, ref = _case(96, 192, rows)
        layer = ql.QuantizedLinear(qw, "cpu")
        assert layer.native == layer_variant and f"native C++ ({layer_variant})" in layer.kernel_name()
        # One copy, as many bytes as aten's layout: N*K/2 codes + bf16 scale and zero per group.
        held = sum(b.numel() * b.element_size() for b in layer.buffers())
        assert held == 96 * 192 // 2 + 96 * (192 // 32) * 2 * 2 and layer.duplicate_bytes() == 0
        torch.testing.assert_close(layer.dequantize(), qw.dequantize())
        assert (layer(x) - ref).abs().max() <= TOL * ref.abs().max()


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
    # The native path rounds activations to int8 per group of 32: a tie within twice the noise
    # it measures against float arithmetic may go either way.
    noise = agreed_logprob_noise([(b.outputs[0], g.outputs[0]) for b, g in zip(base, got)])
    print(f"native int4 vs float: logprob noise on agreed tokens {noise:.3g}")
    assert noise < 0.25, f"native and float arithmetic disagree by {noise:.3g} nats on agreed tokens"
    for p, b, g in zip(prompts, base, got, strict=True):
        tie = max(QUANTIZED_TIE, 2 * noise)
        assert_quantized_match(b.outputs[0], g.outputs[0].token_ids, f"native int4 {p!r}", tie)


@pytest.mark.slow
def test_int4_request_alone_and_in_a_batch_of_eight_decode_alike():
    """A request decoded alone and in a batch of eight (default model, its own Q4_1 weights).
    The int4 projections compute a row bit-identically at any row count; the int8 vocabulary
    table (weight-only fp32) sums in an order that depends on the row count. So the two runs
    may differ by fp32 rounding and nothing more: the same greedy tokens, logprobs within 1e-3."""
    llm = LLM("smollm2-135m", kv_cache_memory="64MiB", quantization="int4")
    tok = llm.tokenizer
    texts = [f"Question {i}: name a reason people like {w}." for i, w in enumerate(
        ["tea", "rain", "maps", "music", "trains", "books", "cats", "winter"])]  # fmt: skip
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    together = llm.generate(prompts, params, use_tqdm=False)
    pairs = [(llm.generate([t], params, use_tqdm=False)[0].outputs[0], b.outputs[0])
             for t, b in zip(prompts[:3], together[:3])]  # fmt: skip
    noise = agreed_logprob_noise(pairs)
    print(f"int4 alone vs batch: logprob noise on agreed tokens {noise:.3g}")
    assert noise < 1e-3, f"alone and batched disagree by {noise:.3g} nats on agreed tokens"
    for p, (alone, batched) in zip(texts, pairs):
        assert_quantized_match(alone, batched.token_ids, f"int4 alone vs batch {p!r}", 2 * noise)


@pytest.mark.skipif("avx512_amx" not in VARIANTS, reason="no AMX-INT8 here")
def test_amx_variant_after_another_amx_user_released_the_tiles():
    """oneDNN's bf16 matmuls use AMX where present and release the tiles when done; the AMX
    variant must configure them again at its next call (a stale configuration is an illegal
    instruction), and still agree with the VNNI one."""
    q8 = quantize_weight(torch.randn(64, 576) * 0.1, "int8")
    codes8, scales8 = qk.pack_int8(q8.codes, q8.scales)
    x = torch.randn(32, 576)
    amx, vnni = qk.load_quant_kernels("avx512_amx"), qk.load_quant_kernels("avx512_vnni")
    for _ in range(3):
        a = torch.randn(256, 256).bfloat16()
        torch.mm(a, a)
        assert torch.equal(amx.int8_mm(x, codes8, scales8, 64), vnni.int8_mm(x, codes8, scales8, 64))
