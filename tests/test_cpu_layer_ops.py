"""The fused C++ layer ops (csrc/layer_ops_cpu.cpp) against the torch code they replace, at row
counts on both sides of the kernels' parallel grain, and a whole model through both paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.model.layers.cpu_kernels import load_cpu_kernels
from kvserve.model.layers.kv_quant import dequantize_kv, quantize_kv
from kvserve.model.layers.rotary import apply_rotary

ROWS = [1, 5, 16, 37, 130]


@pytest.fixture(scope="module")
def ops():
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ toolchain here")
    return kernels


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", ROWS)
def test_rms_norm_and_fused_residual_add(ops, n):
    g = torch.Generator().manual_seed(n)
    x, delta = torch.randn(n, 576, generator=g), torch.randn(n, 576, generator=g)
    w = torch.randn(576, generator=g)
    close(ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5))
    residual = x.clone()
    h = ops.add_rms_norm(residual, delta, w, 1e-6)
    assert torch.equal(residual, x + delta)  # the stream is added into in place, exactly
    close(h, F.rms_norm(x + delta, (576,), w, 1e-6))


@pytest.mark.parametrize("n", ROWS)
def test_rotary_in_place_on_strided_views_of_qkv(ops, n):
    g = torch.Generator().manual_seed(n)
    heads, kv_heads, hd = 9, 3, 64
    qkv = torch.randn(n, (heads + 2 * kv_heads) * hd, generator=g)
    cos, sin = torch.randn(n, 1, hd, generator=g), torch.randn(n, 1, hd, generator=g)
    q = qkv[:, : heads * hd].view(n, heads, hd)
    k = qkv[:, heads * hd : (heads + kv_heads) * hd].view(n, kv_heads, hd)
    want_q, want_k = apply_rotary(q.clone(), cos, sin), apply_rotary(k.clone(), cos, sin)
    v_before = qkv[:, (heads + kv_heads) * hd :].clone()
    ops.rotary_inplace(q, cos, sin)
    ops.rotary_inplace(k, cos, sin)
    close(q, want_q)
    close(k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * hd :], v_before)  # v untouched


@pytest.mark.parametrize("n", ROWS)
def test_kv_write_matches_index_put_and_ignores_padding_rows(ops, n):
    g = torch.Generator().manual_seed(n)
    blocks, kv_heads, bs, hd = 20, 3, 16, 64
    slots = torch.randperm(blocks * bs, generator=g)[:n]
    sb, so = slots // bs, slots % bs
    k = torch.randn(n + 3, kv_heads, hd, generator=g)  # 3 padding rows past the slot mapping
    v = torch.randn(n + 3, kv_heads, hd, generator=g)
    kc, vc = torch.zeros(blocks, kv_heads, bs, hd), torch.zeros(blocks, kv_heads, bs, hd)
    want_k, want_v = kc.clone(), vc.clone()
    want_k[sb, :, so], want_v[sb, :, so] = k[:n], v[:n]
    ops.kv_write(kc, vc, k, v, sb, so)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_kv_write_rejects_a_slot_outside_the_pool(ops):
    kc, vc = torch.zeros(2, 1, 4, 8), torch.zeros(2, 1, 4, 8)
    k = torch.ones(1, 1, 8)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.kv_write(kc, vc, k, k, torch.tensor([2]), torch.tensor([0]))
    assert not kc.any()


@pytest.mark.parametrize("hd", [64, 40])  # 40: not a multiple of 16, the scalar loop everywhere
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("round_trip", [False, True])
@pytest.mark.parametrize("codes", [torch.int8, torch.float8_e4m3fn])
def test_kv_write_codes_equals_quantize_kv(ops, dtype, round_trip, hd, codes):
    """Codes and scales exactly as kv_quant computes them (halves rounded to even: bfloat16
    inputs hit exact halves often; a float32 row is made of them), padding rows untouched,
    and with round_trip the rows as the cache gives them back. k is a strided view, as the
    slice of a fused qkv output is."""
    g = torch.Generator().manual_seed(7)
    n, blocks, kv_heads, bs = 200, 16, 3, 16
    slots = torch.randperm(blocks * bs, generator=g)[:n]
    sb, so = slots // bs, slots % bs
    spread = torch.rand(n + 2, kv_heads, 1, generator=g) * 10
    qkv = (torch.randn(n + 2, 2 * kv_heads, hd, generator=g) * spread.repeat(1, 2, 1)).to(dtype)
    qkv[0, 0] = 0  # an all-zero vector: the scale's floor
    # max 127 -> scale exactly 1: every other value a half, rounded to even (2.5 -> 2, -3.5 -> -4)
    qkv[1, 1] = torch.arange(hd, dtype=torch.float32).remainder(9).sub(4).add(0.5).to(dtype)
    qkv[1, 1, 0] = 127
    k, v = qkv[:, :kv_heads], qkv[:, kv_heads:]
    before = qkv.clone()
    kc, vc = (
        torch.zeros(blocks, kv_heads, bs, hd, dtype=codes),
        torch.zeros(blocks, kv_heads, bs, hd, dtype=codes),
    )
    ks, vs = (
        torch.ones(blocks, kv_heads, bs, dtype=torch.bfloat16),
        torch.ones(blocks, kv_heads, bs, dtype=torch.bfloat16),
    )
    ops.kv_write_codes(kc, vc, ks, vs, k, v, sb, so, round_trip)
    for x, cache, scales, old in ((k, kc, ks, before[:, :kv_heads]), (v, vc, vs, before[:, kv_heads:])):
        want_codes, s = quantize_kv(old[:n], codes)
        assert _same_bits(cache[sb, :, so], want_codes) and torch.equal(scales[sb, :, so], s)
        want = dequantize_kv(want_codes, s, dtype) if round_trip else old[:n]
        assert torch.equal(x[:n], want) and torch.equal(x[n:], old[n:])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to the bit (float8 has no torch.equal on the CPU)."""
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("round_trip", [False, True])
def test_fp8_codes_round_as_torch_does(ops, round_trip):
    """The kernel's own float -> float8_e4m3fn conversion (c10's is not inlined where the write
    is compiled) against torch's .to(float8_e4m3fn): every code's value, every midpoint between
    neighbours (ties: half to even, subnormals included) and one float step either side of it,
    in one head vector whose maximum is 448 (scale 1: the values reach the conversion as they
    are), both signs."""
    values = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448, no NaN
    mids = (values[1:] + values[:-1]) / 2
    up, down = torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(-1e9))
    row = torch.cat([torch.tensor([448.0]), values, mids, up, down])
    row = torch.cat([row, -row[1:]])
    hd = row.numel()
    kc, vc = torch.zeros(2, 1, 1, 1, hd, dtype=torch.float8_e4m3fn)
    ks, vs = torch.zeros(2, 1, 1, 1, dtype=torch.bfloat16)
    k, v = row.view(1, 1, hd).clone(), row.view(1, 1, hd).clone()
    ops.kv_write_codes(kc, vc, ks, vs, k, v, torch.tensor([0]), torch.tensor([0]), round_trip)
    assert ks.item() == 1.0
    assert _same_bits(kc.view(hd), row.to(torch.float8_e4m3fn))
    assert torch.equal(k.view(hd), row.to(torch.float8_e4m3fn).float() if round_trip else row)


@pytest.mark.parametrize("n", ROWS)
def test_silu_mul(ops, n):
    gu = torch.randn(n, 2 * 1536, generator=torch.Generator().manual_seed(n)) * 4
    gate, up = gu.chunk(2, dim=-1)
    close(ops.silu_mul(gu), F.silu(gate) * up)


def test_a_model_through_the_fused_ops_equals_the_torch_path(ops, tiny_llama_dir):
    """Whole tiny model, a prefill step then a decode step, logits through both paths."""
    from kvserve import LLM, SamplingParams

    llm = LLM(tiny_llama_dir, kv_cache_memory="16MiB")
    runner = llm.llm_engine.model_runner
    model = runner.model
    assert model.ops is ops and all(layer.ops is ops for layer in model.layers)  # the fused path runs
    prompts = [[5, 9, 17, 33, 2, 41, 7], [11, 3, 8]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    fused = llm.generate(prompts, params, use_tqdm=False)
    model.use_cpu_kernels(None)
    plain = llm.generate(prompts, params, use_tqdm=False)
    model.use_cpu_kernels(ops)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok, lp in la.items():
                assert abs(lp - lb[tok]) < 1e-4


BF16_PATH_NOISE = 0.125  # nats: four 1/32-nat steps of the tiny model's bf16 logits


def bf16_close(got: torch.Tensor, want_fp32: torch.Tensor) -> None:
    """bfloat16 ops compute in float32 and round once: within a bfloat16 step of the float32
    reference rounded (the sum's order can move a value across a rounding boundary)."""
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want_fp32.bfloat16().float(), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("n", [1, 37])
def test_bfloat16_ops_compute_in_float32_and_round_once(ops, n):
    g = torch.Generator().manual_seed(n)
    x, delta = torch.randn(n, 576, generator=g).bfloat16(), torch.randn(n, 576, generator=g).bfloat16()
    w = torch.randn(576, generator=g).bfloat16()
    bf16_close(ops.rms_norm(x, w, 1e-5), F.rms_norm(x.float(), (576,), w.float(), 1e-5))
    residual = x.clone()
    h = ops.add_rms_norm(residual, delta, w, 1e-5)
    assert torch.equal(residual, x + delta)  # bf16 + bf16, rounded once either way
    bf16_close(h, F.rms_norm((x + delta).float(), (576,), w.float(), 1e-5))
    gu = (torch.randn(n, 2 * 1536, generator=g) * 4).bfloat16()
    gate, up = gu.float().chunk(2, dim=-1)
    bf16_close(ops.silu_mul(gu), F.silu(gate) * up)
    heads, hd = 9, 64
    q = torch.randn(n, heads, hd, generator=g).bfloat16()
    cos, sin = torch.randn(n, 1, hd, generator=g).bfloat16(), torch.randn(n, 1, hd, generator=g).bfloat16()
    want = apply_rotary(q.float(), cos.float(), sin.float())
    ops.rotary_inplace(q, cos, sin)
    bf16_close(q, want)


def test_layer_ops_reject_mixed_dtypes(ops):
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="weight must have the activations' dtype"):
        ops.rms_norm(x, torch.randn(64), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.silu_mul(torch.randn(2, 64).half())


def test_a_bfloat16_model_through_the_fused_ops_follows_the_torch_path(ops, tiny_llama_dir):
    """Where the CPU computes bf16 natively (elsewhere the engine runs bf16 requests in fp32),
    the fused bf16 ops replace the torch ones: the same greedy tokens up to a tie of the bf16
    model (bf16 logits come in steps of ~1/32 nat at these magnitudes and tie exactly; the
    torch path rounds after every op, the fused one once, which moved logprobs by up to 0.064
    here), and logprobs within BF16_PATH_NOISE until then."""
    from helpers import assert_quantized_match

    from kvserve import LLM, SamplingParams
    from kvserve.platform.cpu_isa import cpu_isa

    if not cpu_isa().native_bf16:
        pytest.skip("no native bf16 on this CPU: a bfloat16 engine computes in float32")
    llm = LLM(tiny_llama_dir, dtype="bfloat16", kv_cache_memory="16MiB")
    model = llm.llm_engine.model_runner.model
    assert model.dtype == torch.bfloat16 and model.ops is ops
    prompts = [[5, 9, 17, 33, 2, 41, 7], [11, 3, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    fused = llm.generate(prompts, params, use_tqdm=False)
    model.use_cpu_kernels(None)
    plain = llm.generate(prompts, params, use_tqdm=False)
    model.use_cpu_kernels(ops)
    for i, (a, b) in enumerate(zip(fused, plain)):
        got, want = a.outputs[0], b.outputs[0]
        assert_quantized_match(want, got.token_ids, f"bf16 prompt {i}", tie=BF16_PATH_NOISE)
        for step, (la, lb) in enumerate(zip(got.logprobs, want.logprobs)):
            if got.token_ids[:step] != want.token_ids[:step]:
                break  # past a tie the two runs continue different texts
            for tok, lp in la.items():
                if tok in lb:
                    assert abs(lp - lb[tok]) < BF16_PATH_NOISE, (i, step, tok)


@pytest.mark.parametrize("n", [1, 5, 17, 100, 49152])  # tails after the 8-, 16-, 32- and 64-float chunks
def test_row_argmax_equals_torch_max(ops, n):
    """Greedy's pick (sampler.row_argmax): torch.max's indices, the first on ties, the first
    NaN where a row holds one, also with infinities and signed zeros."""
    torch.manual_seed(n)
    x = torch.randn(9, n)
    if n > 3:
        x[1, n // 3] = x[1, n - 1] = x[1].max() + 1  # a tie: the first one
        x[2, n // 2] = float("nan")
        x[2, n - 1] = float("inf")  # a NaN beats even +inf
        x[3] = float("-inf")  # structured output can mask a whole row but one token...
        x[3, n - 2] = 0.0
        x[4] = float("-inf")  # ...or, in a test, all of it
        x[5, : n // 2] = -0.0
        x[5, n // 2 :] = 0.0
        x[6, 0] = float("nan")
        x[7, n - 1] = float("nan")
    x[8] = x[8].abs() + 1
    got = ops.row_argmax(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.max(x, -1).indices), (got, torch.max(x, -1).indices)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops.row_argmax(x.double())


def test_sampler_takes_the_row_argmax_kernel_once_loaded(ops):
    from kvserve.model.layers import sampler

    assert sampler.loaded_cpu_kernels() is ops  # the fixture loaded it in this process
    x = torch.randn(4, 300)
    x[0, 7] = x[0, 200] = 100.0
    assert sampler.row_argmax(x).tolist()[0] == 7
    assert torch.equal(sampler.row_argmax(x), x.argmax(-1))
    assert torch.equal(sampler.row_argmax(x.t()), x.t().argmax(-1))  # not contiguous: copied
