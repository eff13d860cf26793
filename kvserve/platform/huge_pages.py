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
import mmap

import torch

from kvserve.platform.memory import libc

MADV_HUGEPAGE = 14  # <sys/mman.h>
MADV_POPULATE_WRITE = 23  # Linux 5.14: fault pages in writable without writing them
HUGE_PAGE = 2 << 20
FAULT_IN_STEP = 4 * HUGE_PAGE  # ~5-20 ms on the 2-core test machine


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of zeros in a fresh anonymous mapping (zero by definition, so
    nothing writes it), its pages asked to be huge and not yet faulted in: the first write to
    each faults it, or `fault_in` / `PendingFaults` do. A plain `torch.zeros` where huge pages
    cannot be asked for or the tensor fills less than one."""
    nbytes = math.prod(shape) * dtype.itemsize
    if libc() is None or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    raw = torch.frombuffer(mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE), dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    length = min(-(-nbytes // HUGE_PAGE) * HUGE_PAGE, raw.numel() - start)
    libc().madvise(ctypes.c_void_p(raw.data_ptr() + start), ctypes.c_size_t(length), MADV_HUGEPAGE)
    return raw[start : start + nbytes].view(dtype).view(shape)  # keeps the mapping alive


def _populate(lib, start: int, nbytes: int) -> bool:
    """Fault [start, start + nbytes) in writable without writing it; False where the kernel
    cannot (before Linux 5.14), and each page then faults on its first write."""
    lead = start % mmap.PAGESIZE
    return (
        lib.madvise(ctypes.c_void_p(start - lead), ctypes.c_size_t(nbytes + lead), MADV_POPULATE_WRITE) == 0
    )


def fault_in(t: torch.Tensor) -> None:
    """Fault all of `t`'s pages in now, leaving their contents alone."""
    lib = libc()
    if lib is not None and t.device.type == "cpu" and t.nbytes:
        _populate(lib, t.data_ptr(), t.nbytes)


class PendingFaults:
    """Tensors whose pages are still to be faulted in, a slice at a time, when nothing waits.

    The KV pool is zero pages nobody has touched: faulting them all in at start cost 0.8-2.4 s
    of a 1 GiB pool's start on the 2-core test machine (a microVM: the kernel zeroes each huge
    page and the host backs it), and the kernel holds the process's map lock meanwhile, so a
    thread doing it beside the model's load slowed the load as much. Left to fault on first
    write, a step that first reaches a new 2 MiB of every layer's blocks would pay ~60 faults.
    So the engine core steps this while it is idle (`step`, 8 MiB: 5-20 ms here), from
    the moment it is ready; a step that writes an unfaulted page meanwhile faults it itself."""

    def __init__(self, *tensors: torch.Tensor | None) -> None:
        self._lib = libc()
        live = [t for t in tensors if t is not None and t.device.type == "cpu" and t.nbytes]
        self._tensors = live if self._lib is not None else []  # held until their pages are in
        self._done = 0  # bytes of the first tensor faulted in

    def step(self, max_bytes: int = FAULT_IN_STEP) -> bool:
        """Fault in up to `max_bytes` more; True while pages remain."""
        if not self._tensors:
            return False
        t = self._tensors[0]
        nbytes = min(max_bytes, t.nbytes - self._done)
        if not _populate(self._lib, t.data_ptr() + self._done, nbytes):
            self._tensors = []
            return False
        self._done += nbytes
        if self._done == t.nbytes:
            self._tensors.pop(0)
            self._done = 0
        return bool(self._tensors)


def huge_page_full(shape: tuple[int, ...], value: float, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor filled with `value`, in huge pages where the OS grants them,
    every page faulted in."""
    out = huge_page_zeros(shape, dtype)
    if value != 0:
        return out.fill_(value)
    fault_in(out)
    return out


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
    arena = huge_page_zeros((total,), torch.uint8)  # the copies below fault its pages in
    with torch.no_grad():
        for t, offset in zip(moving, offsets):
            t.data = arena[offset : offset + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
    return total
