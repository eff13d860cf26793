"""The CPU paged decode attention kernel (csrc/paged_attention_cpu.cpp) against attention
computed with torch over the same cache: float32, int8 and fp8 e4m3 caches (a bfloat16 scale
per token and kv head), query heads per kv head that take the 16-lane loops and ones that do not, head
sizes the kernel specializes and one it does not, partial blocks, and sequences of very
different lengths in one call. The threads split the sequences by work, so the result must
not depend on how many there are: one thread and two give the same bits. The extension is built
for the CPU at hand (-march=native); on an AVX-512 machine a build for AVX2 alone runs the same
cases, so the 8-lane loops an AVX2-only CPU takes are checked everywhere that can run them.
A prompt's rows laid out as decode rows (each a row of its own causal length over the same
blocks) share their dequantized fp8 blocks, and each row must still get the bits it gets alone.
No timing here (benchmarks/bench_paged_attention.py)."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

from kvserve.model.layers import cpu_kernels
from kvserve.platform.cpu_isa import cpu_isa

KERNELS = cpu_kernels.load_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C++ toolchain here")
CASES = [(9, 3, 64, 16), (4, 1, 64, 16), (5, 1, 64, 8), (8, 8, 128, 16), (6, 2, 80, 16)]


KINDS = ["fp32", "int8", "fp8"]


def _codes(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A 1-byte cache's codes of x and their bfloat16 scales, one per row."""
    top = 127 if kind == "int8" else 448
    scale = (x.abs().amax(-1) / top).bfloat16()
    y = x / scale.float().unsqueeze(-1)
    if kind == "int8":
        return y.round().clamp(-127, 127).to(torch.int8), scale
    return y.clamp(-448, 448).to(torch.float8_e4m3fn), scale


def _case(heads: int, kv_heads: int, head_dim: int, block: int, lens: list[int], kind: str, seed: int,
          shared: bool = False):  # fmt: skip
    """q, caches, scales and block tables of a decode step over `lens` (blocks scattered; with
    `shared`, every sequence reads the same blocks: a prompt's rows)."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block) for n in lens]
    pool = (max(per_seq) if shared else sum(per_seq)) + 7
    order = torch.randperm(pool, generator=g)
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.long)
    at = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = order[at : at + n]
        at += 0 if shared else n
    shape = (pool, kv_heads, block, head_dim)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    if kind == "fp32":
        ks = vs = torch.empty(0, dtype=torch.bfloat16)
    else:
        (k, ks), (v, vs) = _codes(k, kind), _codes(v, kind)
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    return q, k, v, ks, vs, tables, torch.tensor(lens, dtype=torch.long)


def _reference(q, k, v, ks, vs, tables, lens, scale: float) -> torch.Tensor:
    heads, kv_heads, block = q.shape[1], k.shape[1], k.shape[2]
    kf = k.float() * ks.float().unsqueeze(-1) if ks.numel() else k
    vf = v.float() * vs.float().unsqueeze(-1) if vs.numel() else v
    out = torch.empty_like(q)
    for s, n in enumerate(lens.tolist()):
        blocks = tables[s, : -(-n // block)]
        keys = kf[blocks].permute(1, 0, 2, 3).reshape(kv_heads, -1, q.shape[2])[:, :n]  # [kv, n, d]
        vals = vf[blocks].permute(1, 0, 2, 3).reshape(kv_heads, -1, q.shape[2])[:, :n]
        rep = heads // kv_heads
        keys, vals = keys.repeat_interleave(rep, 0), vals.repeat_interleave(rep, 0)
        p = torch.softmax((keys @ q[s].unsqueeze(-1)).squeeze(-1) * scale, -1)  # [heads, n]
        out[s] = (p.unsqueeze(1) @ vals).squeeze(1)
    return out


def _check(module, kind: str, heads: int, kv_heads: int, head_dim: int, block: int) -> None:
    # long decodes first, then a prompt chunk's short rows (a served step), odd lengths throughout
    lens = [203, 190, 177, 41] + list(range(1, 30, 3))
    case = _case(heads, kv_heads, head_dim, block, lens, kind, seed=heads * 100 + head_dim + block)
    scale = head_dim**-0.5
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = module.paged_decode_attention(*case, scale)
        torch.set_num_threads(1)
        one = module.paged_decode_attention(*case, scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two), (kind, heads, kv_heads, head_dim, block)
    torch.testing.assert_close(two, _reference(*case, scale), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block", CASES)
def test_kernel_matches_torch_and_any_thread_count(kind, heads, kv_heads, head_dim, block):
    _check(KERNELS, kind, heads, kv_heads, head_dim, block)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block", CASES[:2] + CASES[3:])
def test_a_prompts_rows_get_the_bits_each_gets_alone(kind, heads, kv_heads, head_dim, block):
    """60 rows of one prompt over the same blocks (a long decode before them, another sequence
    between), in one call with one or two threads: each row equal to the row alone."""
    lens = [150] + list(range(1, 31)) + [77] + list(range(31, 61))
    q, k, v, ks, vs, tables, lens_t = _case(heads, kv_heads, head_dim, block, lens, kind, seed=7, shared=True)
    tables[0] = tables[0].flip(0)  # the long decode and the middle one read the blocks in another order
    tables[31] = tables[31].roll(1)
    scale = head_dim**-0.5

    def attend(rows: slice) -> torch.Tensor:
        return KERNELS.paged_decode_attention(q[rows], k, v, ks, vs, tables[rows], lens_t[rows], scale)

    alone = torch.cat([attend(slice(i, i + 1)) for i in range(len(lens))])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(attend(slice(None)), alone), n
    finally:
        torch.set_num_threads(threads)
    reference = _reference(q, k, v, ks, vs, tables, lens_t, scale)
    torch.testing.assert_close(alone, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not (cpu_isa().avx2 and cpu_isa().avx512), reason="the native build is AVX2's, or none")
def test_an_avx2_only_build_matches_torch_too(tmp_path):
    # the kernel's source alone with a binding of its own (a third of the whole extension's build)
    source = os.path.join(os.path.dirname(cpu_kernels.HEADERS[0]), "paged_attention_cpu.cpp")
    binding = tmp_path / "paged_attention_avx2_binding.cpp"
    binding.write_text(
        '#include "cpu_kernels.h"\n'
        "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n"
        '  m.def("paged_decode_attention", &paged_decode_attention);\n'
        "}\n"
    )
    flags = [f for f in cpu_kernels._CFLAGS if f != "-march=native"] + ["-mavx2", "-mfma"]  # ISA capped
    hashed = b"".join(pathlib.Path(p).read_bytes() for p in (source, binding, cpu_kernels.HEADERS[0]))
    name = cpu_kernels.extension_name("kvserve_paged_attention_avx2", hashed, flags)
    module = cpu_kernels.build_extension(name, [source, str(binding)], flags, cpu_kernels.HEADERS[:1])
    for kind in KINDS:
        for shape in CASES:
            _check(module, kind, *shape)
