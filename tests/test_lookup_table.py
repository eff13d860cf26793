"""lookup_table.py: a tied table's lookup copy in a smaller form only when it is exact."""

from __future__ import annotations

import torch
from helpers import q8_0_like_table

from kvserve.model.layers.lookup_table import compact_lookup_table


def test_q8_0_table_as_int8_groups():
    table = q8_0_like_table(300, 96)
    lut = compact_lookup_table(table)
    assert lut is not None and lut.codes.dtype == torch.int8 and lut.scales.dtype == torch.float16
    assert lut.nbytes() == 300 * 96 + 300 * 3 * 2
    assert torch.equal(lut.rows(torch.arange(300)), table)
    ids = torch.tensor([[5, 0, 299], [7, 7, 1]])  # any id shape, as nn.functional.embedding
    assert torch.equal(lut.rows(ids), table[ids])


def test_bf16_values_as_bf16():
    table = torch.randn(50, 40).bfloat16().float()  # 40 columns: no groups of 32
    lut = compact_lookup_table(table)
    assert lut is not None and lut.codes.dtype == torch.bfloat16 and lut.scales is None
    assert lut.rows(torch.tensor([3, 1])).dtype == torch.float32
    assert torch.equal(lut.rows(torch.arange(50)), table)


def test_no_exact_form_keeps_the_table():
    table = torch.randn(64, 64)
    assert compact_lookup_table(table) is None
    one_off = q8_0_like_table(64, 64)
    one_off[10, 5] = torch.nextafter(one_off[10, 5], torch.tensor(1.0))  # one value off its grid
    assert compact_lookup_table(one_off) is None
    assert compact_lookup_table(torch.randn(8, 32).bfloat16()) is None  # bf16 itself: nothing smaller
