"""The bf16 panel kernel (csrc/bf16_matmul_cpu.cpp, used where the CPU has avx512_bf16 and no
AMX): its layout everywhere; where it runs, its products against the float reference, the
same bits whatever the batch, and a bf16 engine on it against transformers' bf16 model."""

from __future__ import annotations

import logging

import pytest
import torch

from kvserve.model.layers.bf16_panels import (
    bf16_panel_linear,
    load_bf16_kernels,
    pack_bf16,
    panel_layout,
    panel_rows,
    panels_wanted,
    unpack_bf16,
)
from kvserve.platform.cpu_isa import CpuIsa

needs_kernel = pytest.mark.skipif(load_bf16_kernels() is None, reason="no avx512_bf16 without AMX here")


def test_layout_round_trip_and_order():
    w = torch.arange(48 * 10, dtype=torch.float32).view(48, 10).bfloat16()
    p = panel_layout(w)
    assert p.shape == (3, 5, 32)
    assert torch.equal(unpack_bf16(p), w)
    # panel 1, chunk 2: rows 16..31, each with inputs 4 and 5
    assert p[1, 2, :4].tolist() == [w[16, 4].item(), w[16, 5].item(), w[17, 4].item(), w[17, 5].item()]


def test_rows_read_from_panels():
    w = torch.randn(64, 24).bfloat16()
    ids = torch.tensor([0, 17, 63, 17, 5])
    assert torch.equal(panel_rows(panel_layout(w), ids), w[ids])
    assert torch.equal(panel_rows(panel_layout(w), ids.view(5, 1)), w[ids].view(5, 1, 24))


def test_wanted_only_with_avx512_bf16_and_no_amx(monkeypatch):
    monkeypatch.delenv("KVSERVE_BF16_PANELS", raising=False)
    monkeypatch.delenv("KVSERVE_DISABLE_CPU_KERNELS", raising=False)
    zen4 = CpuIsa(frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}))
    amx = CpuIsa(zen4.flags | {"amx_bf16", "amx_int8", "amx_tile"})
    avx2 = CpuIsa(frozenset({"avx2", "fma"}))
    assert panels_wanted(zen4) and not panels_wanted(amx) and not panels_wanted(avx2)
    monkeypatch.setenv("KVSERVE_BF16_PANELS", "0")
    assert not panels_wanted(zen4)


def test_pack_declines_what_the_kernel_does_not_take():
    assert pack_bf16(torch.randn(40, 64).bfloat16()) is None  # not whole panels
    assert pack_bf16(torch.randn(32, 63).bfloat16()) is None  # odd K
    assert pack_bf16(torch.randn(32, 64)) is None  # float32


@needs_kernel
@pytest.mark.parametrize("m", [1, 5, 12, 13, 40])
@pytest.mark.parametrize("n", [48, 64])  # an odd panel count and an even one
def test_kernel_matches_float_reference(m, n):
    """Each output is the exact fp32 sum of bf16 products, rounded once to bf16: within one
    bf16 rounding (2^-8 relative) of the float reference, with and without a bias."""
    torch.manual_seed(m * n)
    w, x, b = torch.randn(n, 96).bfloat16(), torch.randn(m, 96).bfloat16(), torch.randn(n).bfloat16()
    panels = pack_bf16(w)
    for bias in (None, b):
        ref = x.float() @ w.float().T + (0 if bias is None else bias.float())
        y = bf16_panel_linear(x, panels, bias)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        assert ((y.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-5).all()


@needs_kernel
def test_kernel_same_bits_for_any_batch():
    torch.manual_seed(1)
    w, x = torch.randn(80, 128).bfloat16(), torch.randn(29, 128).bfloat16()
    panels = pack_bf16(w)
    whole = bf16_panel_linear(x, panels, None)
    for i in (0, 11, 28):
        assert torch.equal(bf16_panel_linear(x[i : i + 1], panels, None), whole[i : i + 1])
    assert torch.equal(bf16_panel_linear(x.view(29, 1, 128), panels, None).view(29, 80), whole)


@needs_kernel
def test_kernel_names_bad_input():
    panels = pack_bf16(torch.randn(32, 64).bfloat16())
    with pytest.raises(RuntimeError, match="x: contiguous bfloat16"):
        load_bf16_kernels().bf16_mm(torch.randn(2, 64), panels, None)
    with pytest.raises(RuntimeError, match="x has 62 columns"):
        load_bf16_kernels().bf16_mm(torch.randn(2, 62).bfloat16(), panels, None)


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases, a tied lm_head
def test_bf16_engine_on_panels_matches_transformers(arch, tiny_llama_dir, tiny_qwen2_dir, caplog):
    """A bf16 engine whose projections run on the panels: greedy tokens equal transformers'
    own bf16 model, or first differ where that model's top two logits are within a bf16 tie."""
    from helpers import reference_greedy, reference_logits
    from transformers import AutoModelForCausalLM

    from kvserve import LLM, SamplingParams

    path = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    with caplog.at_level(logging.INFO):
        llm = LLM(path, dtype="bfloat16", kv_cache_memory="16MiB")
    assert "kvserve bf16 panels" in caplog.text
    model = llm.llm_engine.model_runner.model
    if arch == "qwen2":  # tied: the panels serve the embedding's lookups, the table held once
        assert model.embed.weight.numel() == 0 and model.embed.lookup.rows(torch.tensor([3])).shape == (1, 64)
        assert model.duplicate_weight_bytes() == 0
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    prompts = [[5, 9, 17, 33, 2, 41, 7], [11, 3, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    exact = 0
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        got = out.outputs[0].token_ids
        want = reference_greedy(hf, prompt, 8, None)
        if got == want:
            exact += 1
            continue
        i = next(k for k in range(len(want)) if got[k] != want[k])
        top2 = reference_logits(hf, prompt + want[:i])[-1].topk(2).values
        assert (top2[0] - top2[1]).item() <= 0.125, (prompt, i, got, want)  # four 1/32-nat bf16 steps
    assert exact >= len(prompts) - 1
