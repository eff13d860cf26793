"""The fused C++ layer ops (csrc/layer_ops_cpu.cpp) against the torch code they replace, at row
counts on both sides of the kernels' parallel grain, and a whole model through both paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.model.layers.cpu_kernels import load_cpu_kernels
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
