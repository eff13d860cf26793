"""platform/huge_pages.py: the KV pool's allocator gives the tensor torch.full would, aligned
to a huge page where it asked the OS for them."""

from __future__ import annotations

import gc

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
