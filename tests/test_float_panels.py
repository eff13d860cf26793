"""The float panel kernels (csrc/float_panels_cpu.cpp, used on AVX-512 CPUs without AMX): their
layout everywhere; where they run, their products against the float reference, the same bits
whatever the batch, and engines on them against transformers (fp32: the fidelity rule; bf16:
transformers' own bf16 model)."""

from __future__ import annotations

import logging

import pytest
import torch

from kvserve.model.layers.float_panels import (
    load_panel_kernels,
    pack_panels,
    panel_layout,
    panel_linear,
    panel_rows,
    panel_variant,
    unpack_panels,
)
from kvserve.platform.cpu_isa import CpuIsa

MOD = load_panel_kernels()
DTYPES = [torch.float32, torch.bfloat16]


def runs(dtype: torch.dtype) -> bool:
    return MOD is not None and hasattr(MOD, {torch.float32: "fp32_mm", torch.bfloat16: "bf16_mm"}[dtype])


def needs(dtype: torch.dtype):
    return pytest.mark.skipif(not runs(dtype), reason=f"no {dtype} panel kernel on this CPU")


@pytest.mark.parametrize("dtype", DTYPES)
def test_layout_round_trip_and_order(dtype):
    w = torch.arange(48 * 10, dtype=torch.float32).view(48, 10).to(dtype)
    p = panel_layout(w)
    g = 4 // dtype.itemsize
    assert p.shape == (3, 10 // g, 16 * g)
    assert torch.equal(unpack_panels(p), w)
    # panel 1, chunk 2: rows 16, 17, ... each with inputs 2g .. 2g + g - 1
    want = [w[16 + r, 2 * g + i].item() for r in range(2) for i in range(g)]
    assert p[1, 2, : 2 * g].tolist() == want
    ids = torch.tensor([0, 17, 47, 17, 5])
    assert torch.equal(panel_rows(p, ids), w[ids])
    assert torch.equal(panel_rows(p, ids.view(5, 1)), w[ids].view(5, 1, 10))


def test_variant_follows_the_flags(monkeypatch):
    monkeypatch.delenv("KVSERVE_FLOAT_PANELS", raising=False)
    monkeypatch.delenv("KVSERVE_DISABLE_CPU_KERNELS", raising=False)
    avx512 = CpuIsa(frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}))
    zen4 = CpuIsa(avx512.flags | {"avx512_bf16"})
    amx = CpuIsa(zen4.flags | {"amx_bf16", "amx_int8", "amx_tile"})
    assert panel_variant(zen4) == "avx512_bf16" and panel_variant(avx512) == "avx512"
    assert panel_variant(amx) is None and panel_variant(CpuIsa(frozenset({"avx2", "fma"}))) is None
    monkeypatch.setenv("KVSERVE_FLOAT_PANELS", "0")
    assert panel_variant(zen4) is None


def test_pack_declines_what_no_kernel_takes():
    assert pack_panels(torch.randn(40, 64)) is None  # not whole panels
    assert pack_panels(torch.randn(32, 63).bfloat16()) is None  # odd K in bf16
    assert pack_panels(torch.randn(32, 64).half()) is None  # no fp16 kernel


@pytest.mark.parametrize("dtype", [pytest.param(d, marks=needs(d)) for d in DTYPES])
@pytest.mark.parametrize("m", [1, 5, 12, 13, 40])
@pytest.mark.parametrize("n", [48, 64])  # an odd panel count and an even one
def test_kernel_matches_float_reference(dtype, m, n):
    """fp32: the reference up to summation order; bf16: the exact sum of bf16 products rounded
    once to bf16 (within 2^-8 relative). With and without a bias."""
    torch.manual_seed(m * n)
    w, x, b = (torch.randn(*s).to(dtype) for s in ((n, 96), (m, 96), (n,)))
    panels = pack_panels(w)
    tol = 2**-8 if dtype == torch.bfloat16 else 1e-5
    for bias in (None, b):
        ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
        y = panel_linear(x, panels, bias)
        assert y.dtype == dtype and y.shape == (m, n)
        assert ((y.double() - ref).abs() <= ref.abs() * tol + 1e-4).all()


@pytest.mark.parametrize("dtype", [pytest.param(d, marks=needs(d)) for d in DTYPES])
def test_kernel_same_bits_for_any_batch(dtype):
    torch.manual_seed(1)
    w, x = torch.randn(80, 128).to(dtype), torch.randn(29, 128).to(dtype)
    panels = pack_panels(w)
    whole = panel_linear(x, panels, None)
    for i in (0, 11, 28):
        assert torch.equal(panel_linear(x[i : i + 1], panels, None), whole[i : i + 1])
    assert torch.equal(panel_linear(x.view(29, 1, 128), panels, None).view(29, 80), whole)


@needs(torch.float32)
def test_kernel_names_bad_input():
    panels = pack_panels(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="x: contiguous float32"):
        MOD.fp32_mm(torch.randn(2, 64).bfloat16(), panels, None)
    with pytest.raises(RuntimeError, match="x has 62 columns"):
        MOD.fp32_mm(torch.randn(2, 62), panels, None)
    with pytest.raises(RuntimeError, match="bias: contiguous float32"):
        MOD.fp32_mm(torch.randn(2, 64), panels, torch.randn(31))


@needs(torch.float32)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases, a tied lm_head
def test_fp32_engine_on_panels_matches_transformers(arch, tiny_llama_dir, tiny_qwen2_dir, caplog):
    """An fp32 engine on the panels: greedy tokens equal the fp32 reference's up to the
    fidelity near-tie rule; a tied table is held once (its lookups read the panels)."""
    from conftest import load_reference
    from helpers import assert_greedy_match, reference_greedy

    from kvserve import LLM, SamplingParams

    path = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    with caplog.at_level(logging.INFO):
        llm = LLM(path, kv_cache_memory="16MiB")
    assert "kvserve float32 panels" in caplog.text
    model = llm.llm_engine.model_runner.model
    if arch == "qwen2":
        assert model.embed.weight.numel() == 0 and model.duplicate_weight_bytes() == 0
    hf = load_reference(path)
    prompts = [[5, 9, 17, 33, 2, 41, 7], [11, 3, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    exact = sum(
        assert_greedy_match(hf, p, reference_greedy(hf, p, 8, None), o.outputs[0].token_ids, f"{arch} {i}")
        for i, (p, o) in enumerate(zip(prompts, outs))
    )
    assert exact >= len(prompts) - 1


@needs(torch.bfloat16)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_engine_on_panels_matches_transformers(arch, tiny_llama_dir, tiny_qwen2_dir, caplog):
    """A bf16 engine on the panels: greedy tokens equal transformers' own bf16 model's, or first
    differ where that model's top two logits are within a bf16 tie."""
    from helpers import reference_greedy, reference_logits
    from transformers import AutoModelForCausalLM

    from kvserve import LLM, SamplingParams

    path = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    with caplog.at_level(logging.INFO):
        llm = LLM(path, dtype="bfloat16", kv_cache_memory="16MiB")
    assert "kvserve bfloat16 panels" in caplog.text
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
