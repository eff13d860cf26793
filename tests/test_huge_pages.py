"""platform/huge_pages.py: the KV pool's allocator gives the tensor torch.full would, aligned
to a huge page where it asked the OS for them."""

from __future__ import annotations

import gc
import os
import re

import pytest
import torch

from kvserve.platform.huge_pages import HUGE_PAGE, huge_page_full
from kvserve.platform.memory import libc


@pytest.mark.parametrize(
    "shape, value, dtype",
    [
        ((30, 2, 40, 3, 16, 64), 0, torch.float32),  # ~14 MiB: huge pages asked for
        ((30, 2, 40, 3, 16, 64), 0, torch.int8),
        ((30, 2, 40, 3, 16), 1, torch.bfloat16),  # 115 KiB: below one huge page, plain
        ((2, 3), 0, torch.float8_e4m3fn),
    ],
)
def test_equals_torch_full_and_owns_its_memory(shape, value, dtype):
    t = huge_page_full(shape, value, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert torch.equal(t.float(), torch.full(shape, value, dtype=dtype).float())
    big = t.numel() * t.element_size() >= HUGE_PAGE
    if big and libc() is not None:
        assert t.data_ptr() % HUGE_PAGE == 0
    gc.collect()  # the view alone keeps the over-allocated buffer alive
    t.view(-1)[-1] = 3
    assert t.view(-1)[-1].float().item() == 3 and t.view(-1)[0].float().item() == value


def test_weights_move_into_one_arena_with_their_values_and_objects():
    """weights_in_huge_pages: large parameters and buffers keep their Python objects and
    values, lie in one huge-page-aligned arena in order, 64-byte aligned; small tensors and
    tensors sharing a storage stay where they were."""
    from kvserve.platform.huge_pages import weights_in_huge_pages

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.big = torch.nn.Parameter(torch.randn(700, 1000), requires_grad=False)  # 2.7 MiB
    module.register_buffer("codes", torch.randint(-128, 127, (3, 1001), dtype=torch.int8).repeat(300, 1))
    module.register_buffer("small", torch.randn(10))
    shared = torch.randn(2, 300, 300)
    module.register_buffer("first", shared[0])  # views of one storage: left alone
    module.register_buffer("second", shared[1])
    before = {name: t.clone() for name, t in module.state_dict().items()}
    objects = {name: id(t) for name, t in module.state_dict(keep_vars=True).items()}
    places = {name: t.data_ptr() for name, t in module.state_dict().items()}
    moved = weights_in_huge_pages(module)
    after = module.state_dict(keep_vars=True)
    assert {name: id(t) for name, t in after.items()} == objects
    for name, t in after.items():
        assert torch.equal(t, before[name]), name
    for name in ("small", "first", "second"):
        assert after[name].data_ptr() == places[name], name
    if libc() is None:
        assert moved == 0
        return
    big, codes = after["big"], after["codes"]
    assert moved == big.nbytes + -(-codes.nbytes // 64) * 64
    assert big.data_ptr() % HUGE_PAGE == 0 and codes.data_ptr() == big.data_ptr() + big.nbytes
    assert big.untyped_storage().data_ptr() == codes.untyped_storage().data_ptr()  # one arena


def test_weights_under_one_huge_page_stay_put():
    from kvserve.platform.huge_pages import weights_in_huge_pages

    module = torch.nn.Linear(256, 256)  # 256 KiB: less than one huge page in all
    ptr = module.weight.data_ptr()
    assert weights_in_huge_pages(module) == 0 and module.weight.data_ptr() == ptr


def _resident_bytes(t: torch.Tensor) -> int:
    """Bytes of `t`'s mapping that are resident (its VMA's Rss in /proc/self/smaps)."""
    ptr, rss, inside = t.data_ptr(), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "Rss:":
                rss = int(line.split()[1]) * 1024
    return rss


@pytest.mark.skipif(libc() is None, reason="huge pages are only asked for through glibc")
def test_zero_pool_is_untouched_until_its_pending_faults_are_stepped():
    """The KV pool starts as untouched zero pages (a start does not wait for 1 GiB of page
    faults); PendingFaults brings them in a slice per step without changing what was written."""
    from kvserve.platform.huge_pages import PendingFaults, huge_page_zeros

    t = huge_page_zeros((16, HUGE_PAGE), torch.uint8)  # 32 MiB
    assert t.data_ptr() % HUGE_PAGE == 0 and _resident_bytes(t) < 4 * HUGE_PAGE
    t[3, 5] = 7  # a step wrote here before the faults got to it
    pending = PendingFaults(t, None)
    steps = 1
    while pending.step(max_bytes=4 * HUGE_PAGE):
        steps += 1
    assert steps == 4 and not pending.step()
    if tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2]) < (5, 14):
        pytest.skip("no MADV_POPULATE_WRITE before Linux 5.14: pages fault on first write")
    assert _resident_bytes(t) >= t.nbytes
    assert t[3, 5].item() == 7 and int(t.sum()) == 7


@pytest.mark.skipif(libc() is None, reason="huge pages are only asked for through glibc")
def test_an_idle_engine_core_faults_its_kv_pool_in(tiny_llama_dir):
    """The served engine's core, once ready and idle, brings its untouched pool's pages in
    (engine/core_proc.py), so the first steps to reach them do not pay for it."""
    import time

    from kvserve.config import EngineConfig
    from kvserve.engine.async_llm import AsyncLLM

    if tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2]) < (5, 14):
        pytest.skip("no MADV_POPULATE_WRITE before Linux 5.14: pages fault on first write")
    engine = AsyncLLM(EngineConfig(model=tiny_llama_dir, kv_cache_memory="64MiB", max_model_len=256))
    try:
        pool = engine.ready.kv_cache_bytes
        deadline, resident = time.monotonic() + 60, 0
        while time.monotonic() < deadline and resident < pool:
            resident = _pool_resident_bytes(engine.proc.pid, pool)
            time.sleep(0.2)
        assert resident >= pool, (resident, pool)
    finally:
        engine.shutdown()


def _pool_resident_bytes(pid: int, pool: int) -> int:
    """The largest Rss among the core's anonymous mappings the size of the pool (madvise splits
    the pool's huge-page range off its allocation)."""
    rss, size, anonymous = [0], 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                anonymous = len(head) < 6  # no path
            elif head[0] == "Size:":
                size = int(head[1]) * 1024
            elif head[0] == "Rss:" and anonymous and pool <= size <= pool + HUGE_PAGE:
                rss.append(int(head[1]) * 1024)
    return max(rss)
