"""Quantized weights and KV cache, piece by piece: formats, kernels vs their reference,
GGUF direct loading, the C++ decode kernel vs the PyTorch path for every KV dtype, pool
sizing shared with the planner, bad settings, and tiny models end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.model.layers.attention import AttentionMetadata, PagedAttention
from kvserve.model.layers.cpu_kernels import load_cpu_kernels
from kvserve.model.layers.kv_quant import KV_SCALE_DTYPE, dequantize_kv, kv_storage_dtype, quantize_kv
from kvserve.model.layers.quantization import QWeight, fuse, quantize_weight
from kvserve.model.layers.quantized_linear import QuantizedLinear
from kvserve.model.loader.gguf_quants import gguf_qweight

METHODS = ("int8", "int4", "fp8")
# Worst relative error of one dequantized weight (vs the largest |w| of its row or group).
WEIGHT_TOL = {"int8": 0.005, "int4": 0.04, "fp8": 0.07}


@pytest.mark.parametrize("method", METHODS)
def test_quantize_round_trip(method):
    torch.manual_seed(0)
    w = torch.randn(96, 128)
    qw = quantize_weight(w, method)
    err = (qw.dequantize() - w).abs()
    if method == "int4":
        span = w.view(96, 4, 32).amax(-1) - w.view(96, 4, 32).amin(-1)
        assert (err.view(96, 4, 32) <= span.unsqueeze(-1) * WEIGHT_TOL["int4"]).all()
    else:
        assert (err <= w.abs().amax(1, keepdim=True) * WEIGHT_TOL[method]).all()


@pytest.mark.parametrize("method", METHODS)
def test_quantized_linear_matches_its_weights(method):
    """Kernel path (bf16 activations) and the generic dequantizing path agree with x @ W_q.T."""
    torch.manual_seed(0)
    qw = quantize_weight(torch.randn(160, 128) * 0.1, method)
    x = torch.randn(7, 128)
    ref = x @ qw.dequantize().t()
    layers = [QuantizedLinear(qw, "cpu")]
    if method != "fp8":
        layers.append(QuantizedLinear(qw, "cuda"))  # packed for elsewhere: the dequantizing path
    else:
        scaled = QuantizedLinear(qw, "cpu")
        scaled.use_scaled_mm = True  # the CUDA (Ada/Hopper) path; torch._scaled_mm also runs on CPU
        layers.append(scaled)
    for layer in layers:
        y = layer(x)
        assert y.dtype == torch.float32 and y.shape == (7, 160)
        tol = 0.05 if layer.use_scaled_mm else 0.01  # _scaled_mm also rounds activations to fp8
        if layer.dynamic is not None:  # int4's batched path: its int8 copy, activations to 8 bits
            tol = 0.03
        assert (y - ref).abs().max() <= tol * ref.abs().max(), method
        assert torch.allclose(layer.dequantize(), qw.dequantize(), atol=0.02 * qw.dequantize().abs().max())
    bias = torch.randn(160)
    assert torch.allclose(layers[0](x, bias), layers[0](x) + bias)


def test_int8_and_fp8_tables_serve_lookups():
    w = torch.randn(50, 64)
    for method in ("int8", "fp8"):
        layer = QuantizedLinear(quantize_weight(w, method))
        ids = torch.tensor([3, 0, 49, 3])
        assert torch.equal(layer.embedding(ids, torch.float32), layer.dequantize()[ids])
    with pytest.raises(ValueError, match="quantization"):
        QuantizedLinear(quantize_weight(w, "int4")).embedding(ids, torch.float32)


def _random_blocks(qtype: T, rows: int, cols: int, rng) -> np.ndarray:
    """Valid blocks of a type gguf-py cannot quantize: random codes, sane float16 scales."""
    from gguf.constants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    halves = rng.uniform(0.001, 0.02, (blocks.shape[0], 2)).astype(np.float16)
    blocks[:, 0:4] = halves.view(np.uint8)  # Q4_K: d, dmin
    return raw


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K])
def test_gguf_4bit_blocks_load_directly_as_int4(qtype):
    """The codes are kept; only the per-group scale and zero point become bfloat16."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 512)).astype(np.float32)
    raw = _random_blocks(qtype, 48, 512, rng) if qtype == T.Q4_K else gguf_quantize(w, qtype)
    ref = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float32))
    qw = gguf_qweight(raw, qtype, "int4")
    assert qw.method == "int4" and qw.group_size == 32 and qw.codes.shape == (48, 512)
    # Rounding a scale s and zero z to bfloat16 moves a weight by at most 2^-8 (8|s| + |z|).
    s, z = qw.scales.float().repeat_interleave(32, 1), qw.zeros.float().repeat_interleave(32, 1)
    assert ((qw.dequantize() - ref).abs() <= 2**-8 * (8 * s.abs() + z.abs()) + 1e-6).all()
    layer = QuantizedLinear(qw)
    x = torch.randn(3, 512)
    assert torch.allclose(layer(x), x @ ref.t(), atol=0.02 * (x @ ref.t()).abs().max())


def test_gguf_types_without_a_direct_int4_or_int8_mapping():
    rng = np.random.default_rng(0)
    raw = gguf_quantize(rng.standard_normal((8, 256)).astype(np.float32), T.Q8_0)
    for method in METHODS:
        assert gguf_qweight(raw, T.Q8_0, method) is None
    assert gguf_qweight(_random_blocks(T.Q6_K, 8, 256, rng), T.Q6_K, "int4") is None
    assert gguf_qweight(_random_blocks(T.Q4_K, 8, 256, rng), T.Q4_K, "int8") is None


def test_fuse_keeps_matching_codes_and_requantizes_the_rest():
    torch.manual_seed(0)
    a, b = torch.randn(32, 64), torch.randn(16, 64)
    qa, qb = quantize_weight(a, "int4"), quantize_weight(b, "int4")
    fused = fuse([qa, qb], "int4")
    assert torch.equal(fused.codes, torch.cat([qa.codes, qb.codes]))
    mixed = fuse([qa, b], "int4")  # one part still float: everything goes through float once
    assert isinstance(mixed, QWeight) and mixed.codes.shape == (48, 64)
    assert torch.equal(fuse([a, b], None), torch.cat([a, b]))
    assert isinstance(fuse([a], "int8"), QWeight)


# --- KV cache -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp8_e4m3", "int8"])
def test_kv_quantize_round_trip(name):
    torch.manual_seed(0)
    x = torch.randn(10, 3, 64) * torch.rand(10, 3, 1) * 20
    dtype = kv_storage_dtype(name, torch.float32)
    codes, scales = quantize_kv(x, dtype)
    assert codes.dtype == dtype and codes.element_size() == 1 and scales.dtype == KV_SCALE_DTYPE
    err = (dequantize_kv(codes, scales, torch.float32) - x).abs()
    tol = 0.07 if name == "fp8_e4m3" else 0.006
    assert (err <= tol * x.abs().amax(-1, keepdim=True)).all()


# (head_dim, block_size, query heads, sequence lengths, block tables), 2 kv heads: a run-time
# head size with small blocks (the generic loops on every CPU), and the default model's head
# size (a compile-time one: the int8 cache's 16-lane loops on AVX-512, the 8-lane loops of
# both cache types on AVX2) with its blocks of 16, partial last blocks included.
DECODE_SHAPES = {
    "hd32": (32, 4, 6, [5, 9, 1], [[7, 2], [0, 11, 4], [9]]),
    "hd64": (64, 16, 6, [5, 40, 17], [[7], [0, 11, 4], [9, 2]]),
    # the AVX-512 loops take keys 16 at a time (a 32-token block is two chunks), AVX2's four
    "hd64-bs32": (64, 32, 6, [5, 40, 17], [[7], [0, 11], [9]]),
    # 5 query heads per kv head: more than the AVX-512 loops hold in registers (the generic
    # path there); AVX2's take one head at a time
    "hd64-group5": (64, 16, 10, [5, 40, 17], [[7], [0, 11, 4], [9, 2]]),
}


def _decode_case(kv_name: str, dtype: torch.dtype, shape: str = "hd32"):
    """A random paged cache with 3 sequences, written through PagedAttention itself."""
    torch.manual_seed(1)
    hd, bs, heads, lens, tables = DECODE_SHAPES[shape]
    kvh, nblocks = 2, 12
    store = kv_storage_dtype(kv_name, dtype)
    k_cache = torch.zeros(nblocks, kvh, bs, hd, dtype=store)
    v_cache = torch.zeros_like(k_cache)
    attn = PagedAttention(heads, kvh, hd)
    if store != dtype:
        attn.kv_scales = tuple(torch.ones(nblocks, kvh, bs, dtype=KV_SCALE_DTYPE) for _ in range(2))
    slots_b = [t[p // bs] for t, n in zip(tables, lens) for p in range(n)]
    slots_o = [p % bs for n in lens for p in range(n)]
    k = torch.randn(len(slots_b), kvh, hd, dtype=dtype) * 3
    v = torch.randn(len(slots_b), kvh, hd, dtype=dtype)
    meta = AttentionMetadata(torch.tensor(slots_b), torch.tensor(slots_o))
    if attn.kv_scales is not None:
        attn._write_quantized(k, v, k_cache, v_cache, meta)
    else:
        k_cache[meta.slot_blocks, :, meta.slot_offsets] = k
        v_cache[meta.slot_blocks, :, meta.slot_offsets] = v
    width = max(len(t) for t in tables)
    dmeta = AttentionMetadata(torch.empty(0), torch.empty(0), num_decodes=3)
    dmeta.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    dmeta.decode_seq_lens = torch.tensor(lens)
    q = torch.randn(3, heads, hd, dtype=dtype)
    return attn, q, k_cache, v_cache, dmeta


@pytest.mark.parametrize("shape", list(DECODE_SHAPES))
@pytest.mark.parametrize("kv_name", ["auto", "fp8_e4m3", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_matches_torch_path(kv_name, dtype, shape):
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("C++ kernel not built here")
    attn, q, k_cache, v_cache, meta = _decode_case(kv_name, dtype, shape)
    ref = attn._decode(q, k_cache, v_cache, meta)  # gather + SDPA (KVSERVE_DISABLE_CPU_KERNELS path)
    attn.kernels = kernels
    got = attn._decode(q, k_cache, v_cache, meta)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), ref.float(), atol=tol), (got.float() - ref.float()).abs().max()


def test_quantized_prefill_sees_what_decode_reads(tiny_llama_dir):
    """Fresh prompt chunks attend to K/V after the cache's round trip, so splitting a prompt
    into chunks (which read earlier chunks back from the cache) changes nothing beyond an
    occasional code rounding the other way (the matmuls of a 7-token chunk differ in the last
    bits from those of the whole prompt; one int8 step moved a logprob by 3e-3 here)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompt = list(range(3, 90))
    results = []
    for chunk in (512, 7):
        llm = LLM(tiny_llama_dir, kv_cache_memory="4MiB", kv_cache_dtype="int8", max_num_batched_tokens=chunk)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        results.append([next(iter(e.values())) for e in out.prompt_logprobs[1:]])
    assert np.allclose(results[0], results[1], atol=1e-2)


# --- sizing and settings ------------------------------------------------------------------


def test_pool_holds_about_twice_the_tokens_and_the_planner_agrees():
    from kvserve.engine.core import kv_pool_for
    from kvserve.model.loader.gguf_file import gguf_reader
    from kvserve.model.loader.gguf_loader import gguf_arch
    from kvserve.model.loader.resolve import default_model_file
    from kvserve.planner.plan import PlanRequest, make_plan
    from kvserve.planner.presets import load_model_spec

    path = default_model_file()
    arch = gguf_arch(gguf_reader(path))
    spec = load_model_spec(path)
    budget = 64 * 2**20
    for compute, plan_dtype in (("float32", "float32"), ("bfloat16", "bf16")):
        auto = kv_pool_for(EngineConfig(dtype=compute), arch, budget)
        for kv in ("fp8_e4m3", "int8"):
            pool = kv_pool_for(EngineConfig(dtype=compute, kv_cache_dtype=kv), arch, budget)
            assert pool.num_tokens >= 1.9 * auto.num_tokens, (compute, kv)
            plan = make_plan(
                PlanRequest(model=path, dtype=plan_dtype, kv_cache_dtype=kv, kv_cache_memory=budget), spec
            )
            assert plan.kv_pool == pool


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"quantization": "int3"}, "quantization"),
        ({"quantization": "INT8"}, "quantization"),
        ({"kv_cache_dtype": "fp16"}, "kv_cache_dtype"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
    ],
)
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_none_means_no_quantization():
    assert EngineConfig(quantization="none").quantization is None


# --- tiny models end to end ---------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_tiny_model_quantized_logits_stay_close(tiny_llama_dir, method):
    from kvserve.model.layers.attention import PrefillChunk

    def logits(llm: LLM) -> torch.Tensor:
        runner = llm.llm_engine.model_runner
        n = 40
        meta = AttentionMetadata(
            torch.arange(n) // 16, torch.arange(n) % 16, prefills=[PrefillChunk(0, n, 0)]
        )
        hidden = runner.model(torch.arange(3, 3 + n), torch.arange(n), meta, runner.kv_cache)
        return runner.model.compute_logits(hidden).log_softmax(-1)

    ref = logits(LLM(tiny_llama_dir, kv_cache_memory="1MiB"))
    llm = LLM(tiny_llama_dir, kv_cache_memory="1MiB", quantization=method)
    model = llm.llm_engine.model_runner.model
    assert all(len(layer.quant) == 4 for layer in model.layers)
    assert model.embed_q is not None and model.lm_head_q is not None  # this tiny Llama is untied
    got = logits(llm)
    # A random tiny model is harsh on 4 bits (the quality gates use the real model):
    # correlation of all logprobs measured 0.999 / 0.92 / 0.98 for int8 / int4 / fp8.
    corr = torch.corrcoef(torch.stack([got.flatten(), ref.flatten()]))[0, 1].item()
    assert corr > {"int8": 0.99, "int4": 0.85, "fp8": 0.95}[method], corr
    out = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


def test_eval_perplexity_cli(tiny_llama_dir, capsys):
    from kvserve.entrypoints.cli import main

    rc = main(["eval", "perplexity", tiny_llama_dir, "--max-tokens", "300", "--no-progress",
               "--kv-cache-memory", "2MiB", "--kv-cache-dtype", "int8"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert "perplexity" in out and "tokens/s" in out and "kv-cache int8" in out
    assert main(["eval", "perplexity", tiny_llama_dir, "--quantization", "int3"]) == 2
    assert "quantization" in capsys.readouterr().err
