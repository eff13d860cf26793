"""Projections and the vocabulary table split over the tensor-parallel ranks; each module
loads its own shard from full (or already sliced) checkpoint tensors.

- `ColumnParallelLinear` keeps a run of output rows; its output stays split (the next layer
  consumes it split). `QKVParallelLinear` keeps whole GQA groups (tp_sharding.head_shard),
  `MergedColumnParallelLinear` the same run of gate and of up rows.
- `RowParallelLinear` keeps a run of input columns and all-reduces its partial outputs.
- `VocabParallelEmbedding` keeps a run of vocabulary rows; lookups outside it give zeros and
  an all-reduce fills them in. `ParallelLMHead` gathers the logit pieces on rank 0 only,
  where sampling happens.

Quantized weights (int8 / int4 / fp8) are quantized per output row (int4 per group of 32
inputs), so a column shard's codes equal the matching rows of the whole matrix's. A row
shard is quantized whole and then sliced (the checkpoint tensor is read whole for that, one
projection at a time), so every rank uses exactly the codes a single process would.
With one rank every collective is the identity and these are plain projections.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.distributed.parallel_state import get_tp_group
from kvserve.model.layers.linear import float_kernel_name, linear, pack_float
from kvserve.model.layers.lookup_table import LookupTable, PanelLookup, compact_lookup_table
from kvserve.model.layers.quantization import QWeight, fuse, quantize_weight
from kvserve.model.layers.quantized_linear import QuantizedLinear
from kvserve.model.layers.tp_sharding import even_shard, head_shard

Weight = torch.Tensor | QWeight


def take_rows(w: Weight, start: int, stop: int, full: int) -> Weight:
    """Rows [start, stop) of a full tensor; a tensor that is already that shard passes as is."""
    if w.shape[0] != full:
        if w.shape[0] != stop - start:
            raise ValueError(f"weight shard: {w.shape[0]} rows, expected {full} or {stop - start}")
        return w
    if isinstance(w, QWeight):
        return w.map_rows(lambda t: t[start:stop])
    return w[start:stop]


def take_cols(w: Weight, start: int, stop: int, full: int) -> Weight:
    """Input columns [start, stop) of a full [out, in] matrix (or the shard itself)."""
    if w.shape[-1] != full:
        if w.shape[-1] != stop - start:
            raise ValueError(f"weight shard: {w.shape[-1]} columns, expected {full} or {stop - start}")
        return w
    if not isinstance(w, QWeight):
        return w[:, start:stop]
    if w.method != "int4":
        return QWeight(w.method, w.codes[:, start:stop], w.scales, None, 0)
    g = w.group_size
    if start % g or stop % g:  # a shard boundary inside a group: requantize the float slice
        return quantize_weight(w.dequantize()[:, start:stop], "int4")
    return QWeight("int4", w.codes[:, start:stop], w.scales[:, start // g : stop // g],
                   w.zeros[:, start // g : stop // g], g)  # fmt: skip


def hold_packed(module: nn.Module, packed: torch.Tensor | None) -> torch.Tensor | None:
    """`packed`, also registered as the module's (non-persistent) buffer when it is an ordinary
    tensor (kvserve's panels, not oneDNN's opaque one), so that the model runner's move of the
    weights into huge pages takes it along (a bf16 single stream: ~0.92x the time)."""
    if packed is not None and packed.layout == torch.strided:
        module.register_buffer("panels", packed, persistent=False)
    return packed


class ParallelLinear(nn.Module):
    """One rank's [out, in] shard: a float Parameter (oneDNN-packed on CPU) or a QuantizedLinear."""

    def __init__(self, out_features: int, in_features: int, bias: bool = False) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.quant: QuantizedLinear | None = None
        self.packed: torch.Tensor | None = None

    def set_weight(self, w: Weight, device: torch.device | str) -> None:
        if isinstance(w, QWeight):
            self.quant = QuantizedLinear(w, device)
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)
        else:
            self.weight.data = w

    def pack(self) -> None:
        """Pack the float weight for oneDNN and drop the plain copy (nothing reads it after:
        holding both would double the weight memory)."""
        if self.quant is None and self.packed is None:
            self.packed = hold_packed(self, pack_float(self.weight))
            if self.packed is not None:
                self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    def kernel_name(self) -> str:
        """What runs this projection (for the start-up log)."""
        if self.quant is not None:
            return self.quant.kernel_name()
        return float_kernel_name(self.weight.dtype, self.packed)

    def packed_bytes(self) -> int:
        """Bytes of oneDNN's copy, which replaced the plain weight."""
        return 0 if self.packed is None else self.packed.numel() * self.packed.element_size()

    def duplicate_bytes(self) -> int:
        return 0 if self.quant is None else self.quant.duplicate_bytes()

    def local(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.forward(x, bias)  # no hooks to run: skip nn.Module.__call__
        return linear(x, self.weight, bias, self.packed)


class ColumnParallelLinear(ParallelLinear):
    """Output rows split; `load` takes the full parts to fuse (q|k|v, gate|up) with each part's
    row run."""

    row_runs: list[tuple[int, int, int]]  # per fused part: (start, stop, full rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.local(x, self.bias)

    def load(
        self, parts: list[Weight], method: str | None, device, biases: list[torch.Tensor] | None = None
    ) -> None:
        mine = [take_rows(p, a, b, n) for p, (a, b, n) in zip(parts, self.row_runs)]
        self.set_weight(fuse(mine, method), device)
        if biases is not None:
            self.bias.data = torch.cat([take_rows(p, a, b, n) for p, (a, b, n) in zip(biases, self.row_runs)])


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q|k|v for this rank's query heads and the KV heads they attend to."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool) -> None:
        tp = get_tp_group()
        self.shard = s = head_shard(num_heads, num_kv_heads, tp.size, tp.rank)
        super().__init__((s.num_q + 2 * s.num_kv) * head_dim, hidden, bias)
        q = (s.q_start * head_dim, (s.q_start + s.num_q) * head_dim, num_heads * head_dim)
        kv = (s.kv_start * head_dim, (s.kv_start + s.num_kv) * head_dim, num_kv_heads * head_dim)
        self.row_runs = [q, kv, kv]


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Fused gate|up: the same run of the intermediate dimension from each."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        tp = get_tp_group()
        a, b = even_shard(intermediate, tp.size, tp.rank)
        super().__init__(2 * (b - a), hidden, bias)
        self.row_runs = [(a, b, intermediate)] * 2


class RowParallelLinear(ParallelLinear):
    """Input columns [start, stop) of `full_in`; partial outputs are summed over the ranks (in
    float32, as one matmul would accumulate them). A bias is whole on every rank, added once
    after the sum."""

    def __init__(self, start: int, stop: int, full_in: int, out_features: int, bias: bool = False) -> None:
        super().__init__(out_features, stop - start, bias)
        self.cols = (start, stop, full_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x, None)
        if self.tp.size > 1:
            y = self.tp.all_reduce(y.float()).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def load(self, w: Weight, method: str | None, device, bias: torch.Tensor | None = None) -> None:
        a, b, n = self.cols
        if isinstance(w, QWeight) and w.method != method:
            w = w.dequantize(self.weight.dtype)
        if method is not None and not isinstance(w, QWeight):
            w = quantize_weight(w, method)  # whole, before slicing (see the module docstring)
        self.set_weight(take_cols(w, a, b, n), device)
        if bias is not None:
            self.bias.data = bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, stop) of the [vocab, hidden] table (int8 / fp8 when quantized)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.vocab = vocab
        self.start, self.stop = even_shard(vocab, self.tp.size, self.tp.rank)
        self.widths = [b - a for a, b in (even_shard(vocab, self.tp.size, r) for r in range(self.tp.size))]
        self.weight = nn.Parameter(torch.empty(self.stop - self.start, hidden), requires_grad=False)
        self.quant: QuantizedLinear | None = None
        self.lookup: LookupTable | PanelLookup | None = None  # compact_lookups / lookups_from_panels

    def load(self, w: torch.Tensor) -> None:
        self.weight.data = take_rows(w, self.start, self.stop, self.vocab)
        self.lookup = None

    def compact_lookups(self) -> bool:
        """Serve lookups from the table's smallest exact form (lookup_table.py) and drop the
        plain weight, for a tied table whose lm_head holds its own packed copy. False (and
        nothing changes) where the table has no smaller exact form."""
        if self.quant is None and self.lookup is None:
            self.lookup = compact_lookup_table(self.weight.data)
            if self.lookup is not None:
                self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)
        return self.lookup is not None

    def lookups_from_panels(self, panels: torch.Tensor) -> None:
        """Serve lookups from a tied lm_head's panels, the table's only copy."""
        self.lookup = PanelLookup(panels)
        self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    def quantize(self, method: str, device) -> None:
        self.quant = QuantizedLinear(quantize_weight(self.weight, method), device)
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.tp.size > 1:
            outside = (ids < self.start) | (ids >= self.stop)
            ids = (ids - self.start).masked_fill(outside, 0)
        if self.quant is not None:
            x = self.quant.embedding(ids, dtype)
        elif self.lookup is not None:
            x = self.lookup.rows(ids)
        else:
            x = nn.functional.embedding(ids, self.weight)
        if self.tp.size > 1:
            x = self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))  # exact: one rank adds its row
        return x


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocabulary run, gathered on rank 0 (None on the other ranks)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__(vocab, hidden)
        self.packed: torch.Tensor | None = None
        self.tied = False

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        self.quant = embedding.quant
        self.tied = True

    def pack(self, keep_plain: bool = False) -> None:
        """Pack for oneDNN and drop the plain weight, unless `keep_plain`: a tied table whose
        embedding looks rows up in it (oneDNN's blocked layout cannot serve lookups, and an
        unpacked fp32 lm_head measured up to 2.5x slower at 8-32 rows, so it is held twice,
        the lookup copy compacted where it can be: VocabParallelEmbedding.compact_lookups).
        kvserve's panels serve lookups themselves (`panels_serve_lookups`)."""
        if self.quant is None and self.packed is None:
            self.packed = hold_packed(self, pack_float(self.weight))
            if self.packed is not None and not (keep_plain and self.packed.is_mkldnn):
                self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    def panels_serve_lookups(self) -> bool:
        """Whether the table is held as kvserve's panels, which also serve its row lookups."""
        return self.packed is not None and not self.packed.is_mkldnn

    def holds_both(self) -> bool:
        """Whether the table is held packed and plain."""
        return self.packed is not None and self.weight.numel() > 0

    def packed_bytes(self) -> int:
        return 0 if self.packed is None else self.packed.numel() * self.packed.element_size()

    def kernel_name(self) -> str:
        if self.quant is not None:
            return self.quant.kernel_name()
        return float_kernel_name(self.weight.dtype, self.packed)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.quant is not None:
            local = self.quant(hidden).float()
        else:
            local = linear(hidden, self.weight, None, self.packed).float()
        return self.tp.gather_last_dim(local, self.widths)
