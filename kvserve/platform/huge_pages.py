"""Tensors backed by transparent huge pages (Linux madvise(MADV_HUGEPAGE)): the KV pool, and
on the CPU a model's weights.

For the KV pool: a decode step reads each sequence's blocks scattered over the whole pool, a
few KiB per (block, kv head), so with 4 KiB pages nearly every block read misses the TLB (a
two-dimensional page walk in a VM), and a 1-byte cache's 1 KiB blocks pay that per KiB. With
the pool in 2 MiB pages the paged attention kernel ran 4-8% faster for a float32 cache and
7-15% for an int8 one on this project's 2-core test machine (benchmarks/bench_paged_attention.py
times both page sizes). The kernel is only asked: where transparent huge pages are off
("never"), or not glibc, the tensor is an ordinary one.
"""

from __future__ import annotations

import ctypes
import itertools
import math

import torch

from kvserve.platform.memory import libc

MADV_HUGEPAGE = 14  # <sys/mman.h>
HUGE_PAGE = 2 << 20


def huge_page_full(shape: tuple[int, ...], value: float, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor filled with `value`, its pages asked to be huge before anything
    touches them (the fill faults them in)."""
    nbytes = math.prod(shape) * dtype.itemsize
    lib = libc()
    if lib is None or nbytes < HUGE_PAGE:
        return torch.full(shape, value, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # a fresh mapping, untouched
    start = -raw.data_ptr() % HUGE_PAGE
    length = min(-(-nbytes // HUGE_PAGE) * HUGE_PAGE, raw.numel() - start)
    lib.madvise(ctypes.c_void_p(raw.data_ptr() + start), ctypes.c_size_t(length), MADV_HUGEPAGE)
    out = raw[start : start + nbytes].view(dtype).view(shape)  # shares raw's storage: keeps it alive
    return out.fill_(value)


def weights_in_huge_pages(module: torch.nn.Module, min_bytes: int = 64 << 10) -> int:
    """Move `module`'s large CPU parameters and buffers into one arena of huge pages and return
    the bytes moved (0 where huge pages cannot be asked for or the weights fill less than one).

    A single-stream decode reads every weight once a token, front to back: in 4 KiB pages each
    page is a TLB miss (a two-dimensional walk in a VM) and the hardware prefetchers stop at
    each page's end. The int4 decode stack took 0.88-0.91x its time with its weights in 2 MiB
    pages (docs/BENCHMARKS.md, issue 16 round 16). Each tensor keeps its Python object (its
    `.data` moves), so whoever holds it sees the new place; views, tensors sharing a storage
    and ones under `min_bytes` stay where they are. The values are copied, not changed."""
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        if t.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous():
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    moving = []
    for group in by_storage.values():
        t = group[0]
        whole = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes
        if len(group) == 1 and whole and t.nbytes >= min_bytes:  # (parameters() and buffers() dedupe)
            moving.append(t)
    offsets, total = [], 0
    for t in moving:
        offsets.append(total)
        total += -(-t.nbytes // 64) * 64  # each tensor 64-byte aligned, as the kernels' loads like
    if libc() is None or total < HUGE_PAGE:
        return 0
    arena = huge_page_full((total,), 0, torch.uint8)
    with torch.no_grad():
        for t, offset in zip(moving, offsets):
            t.data = arena[offset : offset + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
    return total
