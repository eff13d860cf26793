"""The Triton attention kernels against a PyTorch reference, on the CPU under TRITON_INTERPRET=1.

Tiny shapes (the interpreter runs each program in numpy). Covered: GQA, block tables that are
shuffled and non-contiguous, speculative-style rows sharing a table, chunked prefill with an
offset, prefix-cache hits, split-K (several splits, empty splits, a padding row), fp8 / int8 KV with
kv_quant.py's scale convention, the KV write's slot mapping (padding slots skipped), and the
whole Triton backend against the CPU backend through the model runner's seam. Skipped with
the reason when triton is not importable; the import test at the end needs neither triton
nor a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates any kernel

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

from kvserve.model.layers.kv_quant import dequantize_kv, quantize_kv  # noqa: E402

needs_triton = pytest.mark.skipif(
    not HAVE_TRITON, reason="triton is not importable (pip install '.[test]' installs triton==3.7.1)"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BS = 16  # block size


def _pool(num_blocks: int, kvh: int, hd: int, dtype: torch.dtype, kv_dtype, gen: torch.Generator):
    """Random K/V pools (or 1-byte codes + scales) in kvserve's [blocks, kv_heads, bs, hd] layout."""
    k = torch.randn(num_blocks, kvh, BS, hd, generator=gen).to(dtype)
    v = torch.randn(num_blocks, kvh, BS, hd, generator=gen).to(dtype)
    if kv_dtype is None:
        return k, v, None, None
    kc, ks = quantize_kv(k, kv_dtype)
    vc, vs = quantize_kv(v, kv_dtype)
    return kc, vc, ks, vs


def _dense(cache, scales, table: list[int], length: int, dtype) -> torch.Tensor:
    """[kv_heads, length, hd] of one sequence, read through its table (dequantized)."""
    blocks = cache[torch.tensor(table)]
    if scales is not None:
        blocks = dequantize_kv(blocks, scales[torch.tensor(table)], dtype)
    kvh = blocks.shape[1]
    return blocks.to(dtype).transpose(0, 1).reshape(kvh, -1, blocks.shape[-1])[:, :length]


def _ref_attend(q, keys, values, first_pos: int, scale: float) -> torch.Tensor:
    """q [n, heads, hd] at positions first_pos.. attending causally to keys [kvh, L, hd]."""
    n, heads, _ = q.shape
    group = heads // keys.shape[0]
    k = keys.float().repeat_interleave(group, 0)
    v = values.float().repeat_interleave(group, 0)
    s = torch.einsum("nhd,hld->hnl", q.float(), k) * scale
    pos = torch.arange(keys.shape[1])
    allowed = pos[None, :] <= (first_pos + torch.arange(n))[:, None]
    s = s.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hnl,hld->nhd", s.softmax(-1), v)


def _on_device(*tensors):
    """The kernels' inputs on the device they run on (references stay on the CPU)."""
    return [None if t is None else t.to(DEVICE) for t in tensors]


def _tol(dtype):
    return {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]


@needs_triton
@pytest.mark.parametrize(
    "dtype,heads,kvh,kv_dtype,splits",
    [
        (torch.float32, 4, 2, None, None),  # GQA 2:1, splits from the table width
        (torch.bfloat16, 4, 1, None, 3),  # MQA, 3 splits (some rows leave splits empty)
        (torch.float16, 2, 2, None, 1),  # MHA, one split
        (torch.bfloat16, 4, 2, torch.float8_e4m3fn, 2),  # fp8 KV
        (torch.float32, 2, 1, torch.int8, None),  # int8 KV
    ],
)
def test_paged_decode(dtype, heads, kvh, kv_dtype, splits):
    from kvserve.attention_backends.triton_kernels.paged_decode import paged_decode

    gen = torch.Generator().manual_seed(0)
    hd, nb = 32, 12
    kc, vc, ks, vs = _pool(nb, kvh, hd, dtype, kv_dtype, gen)
    perm = torch.randperm(nb, generator=gen).tolist()
    # rows: a long shuffled table, a one-token row, two speculative rows on one table, padding
    tables = [perm[:5], perm[5:6], perm[6:9], perm[6:9], [0]]
    lens = [5 * BS - 3, 1, 2 * BS + 5, 2 * BS + 6, 0]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(tables), heads, hd, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan")).to(DEVICE)
    scale = hd**-0.5
    args = _on_device(q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32))
    paged_decode(*args, scale, out, *_on_device(ks, vs), num_splits=splits)
    out = out.cpu()
    for i, (t, n) in enumerate(zip(tables, lens)):
        if n == 0:
            assert torch.equal(out[i], torch.zeros_like(out[i])), "a padding row must come out as zeros"
            continue
        keys, values = _dense(kc, ks, t, n, dtype), _dense(vc, vs, t, n, dtype)
        ref = _ref_attend(q[i : i + 1], keys, values, n - 1, scale)
        torch.testing.assert_close(out[i : i + 1].float(), ref, atol=_tol(dtype), rtol=_tol(dtype))


@needs_triton
def test_decode_split_count():
    from kvserve.attention_backends.triton_kernels.constants import DECODE_MAX_SPLITS as MAX_SPLITS
    from kvserve.attention_backends.triton_kernels.constants import num_decode_splits

    assert num_decode_splits(1, 16) == 1
    assert num_decode_splits(16, 16) == 1  # 256 tokens
    assert num_decode_splits(17, 16) == 2
    assert num_decode_splits(10_000, 16) == MAX_SPLITS


@needs_triton
@pytest.mark.parametrize(
    "dtype,heads,kvh,kv_dtype",
    [(torch.float32, 4, 2, None), (torch.bfloat16, 2, 1, None), (torch.bfloat16, 4, 2, torch.float8_e4m3fn)],
)
def test_paged_prefill_chunks_and_prefix_hits(dtype, heads, kvh, kv_dtype):
    """Three chunks in one launch: a fresh prompt, a later chunk (offset not block-aligned) and a
    prefix-cache hit (context a whole number of blocks), over shuffled blocks."""
    from kvserve.attention_backends.triton_kernels.paged_prefill import paged_prefill

    gen = torch.Generator().manual_seed(1)
    hd, nb = 32, 16
    kc, vc, ks, vs = _pool(nb, kvh, hd, dtype, kv_dtype, gen)
    perm = torch.randperm(nb, generator=gen).tolist()
    chunks = [  # (table, context_len, query_len)
        (perm[0:3], 0, 37),
        (perm[3:7], 21, 30),
        (perm[7:10], 2 * BS, 9),
    ]
    width = max(len(t) for t, _, _ in chunks)
    bt = torch.tensor([t + [0] * (width - len(t)) for t, _, _ in chunks], dtype=torch.int32)
    lens = [n for _, _, n in chunks]
    qs = (
        torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32) + 2
    )  # 2 decode rows first
    total = int(qs[-1])
    q = torch.randn(total, heads, hd, generator=gen).to(dtype)
    out = torch.zeros_like(q).to(DEVICE)
    ctx = torch.tensor([c for _, c, _ in chunks], dtype=torch.int32)
    scale = hd**-0.5
    paged_prefill(*_on_device(q, kc, vc, bt, qs, ctx), max(lens), scale, out, *_on_device(ks, vs))
    out = out.cpu()
    assert torch.equal(out[:2], torch.zeros_like(out[:2])), "rows outside the chunks are not written"
    for i, (t, c, n) in enumerate(chunks):
        keys, values = _dense(kc, ks, t, c + n, dtype), _dense(vc, vs, t, c + n, dtype)
        s = int(qs[i])
        ref = _ref_attend(q[s : s + n], keys, values, c, scale)
        torch.testing.assert_close(out[s : s + n].float(), ref, atol=_tol(dtype), rtol=_tol(dtype))


@needs_triton
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn, torch.int8])
def test_kv_write_slot_mapping(kv_dtype):
    """Mapped slots get the token's K/V (1-byte caches: bit-exact quantize_kv codes and scales);
    a -1 slot (padding) and every other slot stay untouched."""
    from kvserve.attention_backends.triton_kernels.kv_write import write_kv

    gen = torch.Generator().manual_seed(2)
    kvh, hd, nb, dtype = 2, 24, 4, torch.bfloat16  # head_dim not a power of two: masked lanes
    kc = torch.zeros(nb, kvh, BS, hd, dtype=kv_dtype or dtype)
    vc = torch.zeros_like(kc)
    ks = vs = None
    if kv_dtype is not None:
        ks, vs = (
            torch.zeros(nb, kvh, BS, dtype=torch.bfloat16),
            torch.zeros(nb, kvh, BS, dtype=torch.bfloat16),
        )
    slots = torch.tensor([3 * BS + 5, 0 * BS + 15, 1 * BS + 0, -1, 2 * BS + 7])  # -1: a padding row
    # k and v as strided views of a wider projection output, as the model's qkv split gives them;
    # large values so fp8 codes reach their top binade (rounding carries across exponents)
    wide = (torch.randn(5, 3 * kvh * hd, generator=gen) * 50).to(dtype)
    k = wide[:, : kvh * hd].view(5, kvh, hd)
    v = wide[:, kvh * hd : 2 * kvh * hd].view(5, kvh, hd)
    caches = _on_device(kc, vc, ks, vs)
    write_kv(*_on_device(k, v), caches[0], caches[1], slots.to(DEVICE), caches[2], caches[3])
    kc, vc, ks, vs = [None if t is None else t.cpu() for t in caches]
    written = torch.zeros(nb, BS, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, o = divmod(slot, BS)
        written[b, o] = True
        for x, cache, scales in ((k, kc, ks), (v, vc, vs)):
            if kv_dtype is None:
                assert torch.equal(cache[b, :, o], x[t])
                continue
            codes, sc = quantize_kv(x[t], kv_dtype)
            assert torch.equal(scales[b, :, o], sc)
            assert torch.equal(cache[b, :, o].float(), codes.float())
    assert not kc.float().permute(0, 2, 1, 3)[~written].any(), "only mapped slots are written"
    if ks is not None:
        assert not ks.float().permute(0, 2, 1)[~written].any()


@needs_triton
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_triton_backend_matches_cpu_backend(tiny_llama_dir, monkeypatch, kv_cache_dtype):
    """The whole engine with the Triton backend (interpreted, on CPU tensors) against the CPU
    backend: chunked prefill (32-token budget), a shared prefix hit by later requests, decodes."""
    from conftest import load_reference
    from helpers import assert_greedy_match

    from kvserve.entrypoints.llm import LLM
    from kvserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prefix = list(range(3, 37))  # two full blocks and a bit: later prompts hit the cached blocks
    prompts = [prefix + [40 + i, 50 + i, 60 + i] for i in range(2)]
    kw = dict(kv_cache_memory="4MiB", max_num_batched_tokens=32, kv_cache_dtype=kv_cache_dtype)
    results = {}
    for name in ("cpu", "triton"):
        monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", name)
        llm = LLM(tiny_llama_dir, **kw)
        assert llm.llm_engine.core.model_runner.attn_backend.name == name
        first = llm.generate(prompts[:1], params, use_tqdm=False)  # caches the shared prefix
        outs = first + llm.generate(prompts[1:], params, use_tqdm=False)
        results[name] = [o.outputs[0].token_ids for o in outs]
        if name == "triton":
            assert llm.llm_engine.kv_cache_manager.prefix_cache_hits > 0
    ref = load_reference(tiny_llama_dir)
    for p, want, got in zip(prompts, results["cpu"], results["triton"]):
        assert_greedy_match(ref, p, want, got, f"triton vs cpu ({kv_cache_dtype})")


@needs_triton
def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter does not compile; triton_compile_check.py compiles every kernel to an
    sm_90 cubin (H100 / H200) with the ptxas triton bundles, in a process without TRITON_INTERPRET."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "triton_compile_check.py")
    cmd = [sys.executable, script, "90"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


class _EagerReplay:
    """Stands in for a captured CUDA graph on the CPU: a replay re-runs the forward over the
    graph runner's persistent buffers, padding rows included, into the fixed output tensor."""

    def __init__(self, graphs, size: int, out: torch.Tensor) -> None:
        self.graphs, self.size, self.out = graphs, size, out

    def replay(self) -> None:
        g, s = self.graphs, self.size
        self.out.copy_(g.model(g.input_ids[:s], g.positions[:s], g._meta(s), g.kv_cache))


@needs_triton
def test_decode_graph_buffers_give_eager_results(tiny_llama_dir, monkeypatch):
    """Decode steps through the graph runner's buffers (3 requests padded to the size-4 graph:
    a padding row with slot -1 and length 0) produce the eager tokens; only the capture itself
    needs a GPU."""
    from kvserve.entrypoints.llm import LLM
    from kvserve.sampling_params import SamplingParams
    from kvserve.worker.cuda_graphs import DecodeGraphRunner

    monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "triton")
    llm = LLM(tiny_llama_dir, kv_cache_memory="4MiB", max_num_seqs=4)
    runner = llm.llm_engine.core.model_runner
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [[5 + i, 9, 40 + i, 17 * i + 3] for i in range(3)]
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    graphs = DecodeGraphRunner(runner.model, runner.kv_cache, runner.attn_backend, 4, max_blocks_per_seq=8)
    hidden = runner.model.arch.hidden_size

    def output(size: int) -> torch.Tensor:  # where a captured graph's output lives (the GPU on one)
        return torch.zeros(size, hidden, dtype=runner.dtype, device=runner.device)

    graphs.graphs = {s: (_EagerReplay(graphs, s, out := output(s)), out) for s in graphs.sizes}
    runner.graphs = graphs
    replays = []
    run = graphs.run
    graphs.run = lambda *a: replays.append(a[2].num_decodes) or run(*a)
    replayed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert replays and 3 in replays, "decode steps went through the graph runner"
    assert replayed == eager
