"""A tied vocabulary table's lookup copy, held in the smallest form that gives back its rows
exactly.

On the CPU the lm_head multiplies through oneDNN's packed copy of a tied table, and that
blocked layout cannot serve embedding lookups, so the rows are held a second time for them
(an unpacked lm_head measured up to 2.5x slower). Many tables fit in fewer bytes with no
loss: a GGUF Q8_0 table dequantized to float32 is int8 codes times one fp16 scale per 32
columns (1.06 bytes a value instead of 4), and a bf16 checkpoint run in float32 is its bf16
values. `compact_lookup_table` keeps the smallest such form, checked against every value
of the table when it is built, so a lookup returns the same numbers the plain table would.
"""

from __future__ import annotations

import torch

from kvserve.model.layers.float_panels import panel_rows

GROUP = 32  # GGUF Q8_0's block: one scale per 32 values of a row
_CHUNK_ROWS = 4096  # rows checked at a time, to bound the check's temporaries


class LookupTable:
    """Rows of a [vocab, hidden] float table from int8 codes x per-group scales, or from a
    narrower float type that holds every value exactly."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.codes = codes  # int8 [V, H] (with scales) or a narrower float [V, H]
        self.scales = scales  # [V, H / GROUP], fp16 or fp32; None for a float code table
        self.dtype = dtype  # the table's own dtype, which lookups return

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """table[ids], rebuilt exactly as `compact_lookup_table` checked it."""
        c = self.codes[ids]
        if self.scales is None:
            return c.to(self.dtype)
        s = self.scales[ids].to(self.dtype).unsqueeze(-1)
        return (c.to(self.dtype).unflatten(-1, (-1, GROUP)) * s).flatten(-2)

    def nbytes(self) -> int:
        held = (self.codes,) if self.scales is None else (self.codes, self.scales)
        return sum(t.numel() * t.element_size() for t in held)


class PanelLookup:
    """A tied table's rows read from its lm_head's panels (float_panels.py): that layout serves
    lookups, so there is no second copy (`nbytes` 0)."""

    def __init__(self, panels: torch.Tensor) -> None:
        self.panels = panels

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return panel_rows(self.panels, ids)

    def nbytes(self) -> int:
        return 0


def _int8_groups(table: torch.Tensor) -> LookupTable | None:
    """int8 codes with one scale per GROUP columns (amax / 127), if they rebuild every value."""
    if table.dim() != 2 or table.shape[1] % GROUP or table.dtype != torch.float32:
        return None
    codes = torch.empty(table.shape, dtype=torch.int8)
    scales = torch.empty(table.shape[0], table.shape[1] // GROUP, dtype=torch.float32)
    for a in range(0, table.shape[0], _CHUNK_ROWS):
        g = table[a : a + _CHUNK_ROWS].unflatten(-1, (-1, GROUP))
        s = g.abs().amax(-1, keepdim=True) / 127  # so every |code| <= 127
        q = torch.where(s > 0, g / s, 0.0).round_()
        if not torch.equal(q * s, g):
            return None
        codes[a : a + _CHUNK_ROWS] = q.flatten(-2).to(torch.int8)
        scales[a : a + _CHUNK_ROWS] = s.squeeze(-1)
    half = scales.half()
    if torch.equal(half.float(), scales):  # a GGUF Q8_0 scale is fp16 itself
        scales = half
    return LookupTable(codes, scales, table.dtype)


def _narrower_float(table: torch.Tensor) -> LookupTable | None:
    """The table as bf16 or fp16, if either holds every value."""
    for dtype in (torch.bfloat16, torch.float16):
        if dtype.itemsize < table.element_size():
            narrow = table.to(dtype)
            if torch.equal(narrow.to(table.dtype), table):
                return LookupTable(narrow, None, table.dtype)
    return None


def compact_lookup_table(table: torch.Tensor) -> LookupTable | None:
    """The smallest exact lookup form of a float table (int8 groups before a narrower float:
    ~1.1 bytes a value against 2), or None when it has none smaller than itself."""
    if not table.is_floating_point() or table.device.type != "cpu" or table.numel() == 0:
        return None
    return _int8_groups(table) or _narrower_float(table)
