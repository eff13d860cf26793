"""The device-independent parts of the CUDA path, on the CPU: CUDA-graph capture sizes and
padding, the graph pool estimate, on-device sampling's arithmetic (greedy, top-k, top-p,
grammar bitmask), and that every CUDA-only module imports with no GPU and no triton."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvserve.model.layers.device_sampler import apply_bitmask, sample_on_device, unpack_bitmask
from kvserve.worker.cuda_graphs import capture_sizes, graph_pool_bytes_estimate, graph_size_for


def test_capture_sizes_and_padding():
    assert capture_sizes(1) == [1]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    sizes = capture_sizes(128)
    assert [graph_size_for(n, sizes) for n in (1, 2, 3, 5, 17, 100, 128)] == [1, 2, 4, 8, 32, 128, 128]
    assert graph_size_for(129, sizes) is None  # more than max_num_seqs: eager
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_graph_pool_estimate_grows_with_the_batch():
    small = graph_pool_bytes_estimate(8, 4096, 14336, 4096, 1024, 32, 2)
    big = graph_pool_bytes_estimate(256, 4096, 14336, 4096, 1024, 32, 2)
    assert 64 << 20 < small < big < 8 << 30


def test_bitmask_unpacks_like_xgrammar():
    vocab = 70
    allowed = torch.zeros(2, vocab, dtype=torch.bool)
    allowed[0, [0, 31, 32, 69]] = True
    allowed[1, :] = True
    words = torch.zeros(2, 3, dtype=torch.int64)
    for r in range(2):
        for t in allowed[r].nonzero().flatten().tolist():
            words[r, t // 32] |= 1 << (t % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # bit 31: the sign
    assert torch.equal(unpack_bitmask(bitmask, vocab), allowed)
    logits = apply_bitmask(torch.zeros(2, vocab), bitmask)
    assert torch.equal(torch.isfinite(logits), allowed)


def test_sampling_on_device():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen)
    ones = torch.ones(6)
    greedy = sample_on_device(logits, torch.zeros(6), torch.zeros(6, dtype=torch.long), ones)
    assert torch.equal(greedy, logits.argmax(-1))
    top1 = sample_on_device(logits, ones, torch.ones(6, dtype=torch.long), ones, generator=gen)
    assert torch.equal(top1, greedy), "top_k = 1 is greedy"
    tiny_p = sample_on_device(
        logits, ones, torch.zeros(6, dtype=torch.long), torch.full((6,), 1e-6), generator=gen
    )
    assert torch.equal(tiny_p, greedy), "a tiny top_p keeps only the most likely token"
    k = torch.tensor([3, 3, 3, 5, 5, 5])
    top_sets = [set(logits[r].topk(int(k[r])).indices.tolist()) for r in range(6)]
    for _ in range(20):
        drawn = sample_on_device(logits, ones * 2.0, k, ones, generator=gen)
        assert all(int(drawn[r]) in top_sets[r] for r in range(6))
    bitmask = torch.zeros(6, 2, dtype=torch.int32)
    bitmask[:, 1] = 1 << 3  # only token 35
    forced = sample_on_device(logits, ones, torch.zeros(6, dtype=torch.long), ones, bitmask, gen)
    assert forced.tolist() == [35] * 6


def test_cuda_only_modules_import_without_gpu_or_triton():
    """No GPU here, and triton hidden: the modules import, and choosing the Triton backend says why not."""
    code = """
import sys
sys.modules["triton"] = None  # import triton -> ImportError, as without the package
import torch
import kvserve.attention_backends.triton_backend
import kvserve.attention_backends.triton_kernels
import kvserve.worker.cuda_graphs
import kvserve.model.layers.device_sampler
from kvserve.attention_backends import make_backend
assert make_backend(torch.device("cpu"), 16).name == "cpu"
try:
    make_backend(torch.device("cuda"), 16)
except ImportError as e:
    assert "triton" in str(e), e
    print("OK")
"""
    env_py = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert env_py.stdout.strip() == "OK", env_py.stderr


def test_graph_buffers_pad_a_decode_step():
    """A 3-row decode step copied into the size-4 graph's buffers: its rows as given, the padding
    row storing nothing (slot -1) and attending to nothing (length 0). No capture: no GPU here."""
    from types import SimpleNamespace

    from kvserve.worker.cuda_graphs import DecodeGraphRunner

    kv = torch.zeros(2, 2, 8, 2, 16, 4)  # [layers, k/v, blocks, kv_heads, block_size, head_dim]
    runner = DecodeGraphRunner(None, kv, SimpleNamespace(block_size=16), max_num_seqs=8, max_blocks_per_seq=6)
    assert runner.sizes == [1, 2, 4, 8]
    assert runner.size_for(3) is None and not runner.fits(_decode_meta(3))  # nothing captured: eager
    runner.graphs = {s: None for s in runner.sizes}  # as if captured
    assert runner.fits(_decode_meta(3)) and not runner.fits(_decode_meta(9))  # 9 > max_num_seqs
    runner.load(torch.tensor([9] * 8), torch.tensor([1] * 8), _decode_meta(8))  # a bigger step before
    meta = _decode_meta(3)
    assert runner.load(torch.tensor([5, 6, 7]), torch.tensor([20, 33, 40]), meta) == 4
    assert runner.input_ids[:3].tolist() == [5, 6, 7]
    assert runner.positions[:3].tolist() == [20, 33, 40]
    assert runner.slot_mapping[:4].tolist() == meta.slot_mapping.tolist() + [-1]
    assert runner.seq_lens[:4].tolist() == meta.decode_seq_lens.tolist() + [0]
    assert torch.equal(runner.block_tables[:3, :2], meta.decode_block_tables)
    graph_meta = runner._meta(4)
    assert graph_meta.num_decodes == 4 and graph_meta.decode_num_splits == 1  # 6 blocks x 16 tokens
    assert graph_meta.slot_mapping.data_ptr() == runner.slot_mapping.data_ptr()  # the buffers themselves
    with pytest.raises(RuntimeError, match="CUDA"):
        runner.capture()


def _decode_meta(n: int):
    from kvserve.attention_backends.triton_backend import TritonAttentionMetadata

    return TritonAttentionMetadata(
        None, n, torch.arange(n) * 16 + 3, num_decodes=n,
        decode_block_tables=torch.arange(2 * n, dtype=torch.int32).view(n, 2),
        decode_seq_lens=torch.arange(n, dtype=torch.int32) + 20,
    )  # fmt: skip
