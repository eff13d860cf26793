"""CPU ISA detection and dispatch: flag parsing, oneDNN's cap, the bf16 fallback on a CPU
without native bf16 (forced here by patching the detected flags, so it runs on any machine)
and the start-up kernel log."""

from __future__ import annotations

import logging
import re

import pytest

from kvserve import LLM, SamplingParams
from kvserve.platform import cpu_isa as isa_mod
from kvserve.platform.cpu_isa import CpuIsa, cap_flags, cpu_compute_dtype, read_cpu_flags

AVX2_ONLY = CpuIsa(frozenset({"avx2", "fma"}))
SAPPHIRE = CpuIsa(frozenset(isa_mod.WANTED))


def test_read_cpu_flags(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 fma avx512f amx_tile\n\nflags\t: other\n")
    assert read_cpu_flags(str(f)) == {"fpu", "sse", "avx2", "fma", "avx512f", "amx_tile"}
    assert read_cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_onednn_cap_drops_flags_above_it():
    flags = frozenset(isa_mod.WANTED)
    assert cap_flags(flags, "AVX2") == {"avx2", "fma"}
    assert cap_flags(flags, "avx512_core_vnni") == {"avx2", "fma", "avx_vnni", "avx512f", "avx512bw",
                                                    "avx512vl", "avx512_vnni"}  # fmt: skip
    assert cap_flags(flags, None) == flags and cap_flags(flags, "NOT_AN_ISA") == flags


def test_isa_questions():
    assert AVX2_ONLY.avx2 and not AVX2_ONLY.avx512 and not AVX2_ONLY.native_bf16 and not AVX2_ONLY.amx
    assert SAPPHIRE.avx512 and SAPPHIRE.vnni and SAPPHIRE.native_bf16 and SAPPHIRE.amx
    assert CpuIsa(frozenset({"avx512_bf16"})).native_bf16
    assert CpuIsa(frozenset()).describe() == "no AVX2"


def test_bf16_falls_back_without_native_support(caplog):
    with caplog.at_level(logging.WARNING):
        assert cpu_compute_dtype("bfloat16", "cpu", AVX2_ONLY) == "float32"
    assert "computing in float32" in caplog.text
    assert cpu_compute_dtype("bfloat16", "cpu", SAPPHIRE) == "bfloat16"
    assert cpu_compute_dtype("bfloat16", "cuda", AVX2_ONLY) == "bfloat16"
    assert cpu_compute_dtype("float32", "cpu", AVX2_ONLY) == "float32"


@pytest.mark.parametrize("isa", [AVX2_ONLY, SAPPHIRE], ids=["no-bf16", "native-bf16"])
def test_engine_bf16_dispatch(tiny_llama_dir, monkeypatch, caplog, isa):
    """Without native bf16 a bf16 engine is the fp32 engine (same tokens, float32 KV); with it,
    bf16 stays bf16. The start-up log names the flags and each path's kernel."""
    monkeypatch.setattr(isa_mod, "cpu_isa", lambda: isa)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[1, 5, 9, 33, 7], [1, 300, 2, 45]]
    with caplog.at_level(logging.INFO):
        bf16 = LLM(tiny_llama_dir, dtype="bfloat16", kv_cache_memory="8MiB")
    runner = bf16.llm_engine.model_runner
    got = [o.outputs[0].token_ids for o in bf16.generate(prompts, params, use_tqdm=False)]
    if isa.native_bf16:
        assert str(runner.model.dtype) == "torch.bfloat16"
        return
    assert str(runner.model.dtype) == "torch.float32" and str(runner.kv_cache.dtype) == "torch.float32"
    assert "no avx512_bf16" in caplog.text
    assert "CPU flags: avx2 fma (native bf16: no)" in caplog.text
    # float32 projections: oneDNN's, or kvserve's panels where the real CPU has AVX-512 without AMX
    assert re.search(r"projections: (oneDNN packed float32|kvserve float32 panels)", caplog.text)
    fp32 = LLM(tiny_llama_dir, kv_cache_memory="8MiB")
    want = [o.outputs[0].token_ids for o in fp32.generate(prompts, params, use_tqdm=False)]
    assert got == want
