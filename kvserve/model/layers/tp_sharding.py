"""Which slice of each weight a tensor-parallel rank owns (arithmetic only, no communication).

Attention heads are split by KV-head groups so each rank keeps whole GQA groups: with tp <=
num_kv_heads the KV heads are divided into contiguous runs as evenly as possible (sizes may
differ by one, e.g. SmolLM2's 3 KV heads over 2 ranks: 2 + 1, with their 6 + 3 query heads);
with tp > num_kv_heads every KV head is replicated on tp / num_kv_heads ranks, which split its
query heads. The MLP's intermediate dimension and the vocabulary are split into even runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.model.arch import ModelArch


@dataclass(frozen=True)
class HeadShard:
    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


def _even_run(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of run `index` when `total` items are cut into `parts` contiguous runs."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, base + (1 if index < extra else 0)


def head_shard(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> HeadShard:
    group = num_heads // num_kv_heads
    if tp <= num_kv_heads:
        kv_start, num_kv = _even_run(num_kv_heads, tp, rank)
        return HeadShard(kv_start * group, num_kv * group, kv_start, num_kv)
    per_head = tp // num_kv_heads  # ranks sharing one replicated KV head
    kv = rank // per_head
    num_q = group // per_head
    return HeadShard(kv * group + (rank % per_head) * num_q, num_q, kv, 1)


def check_tensor_parallel(arch: ModelArch, tp: int) -> None:
    """ValueError naming the flag when the model cannot be split over `tp` ranks."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size: must be >= 1, got {tp}")
    if tp == 1:
        return
    kv, heads = arch.num_kv_heads, arch.num_heads
    if tp > kv and (tp % kv or (heads // kv) % (tp // kv)):
        raise ValueError(
            f"tensor_parallel_size: {tp} ranks cannot share {kv} KV heads with {heads // kv} query heads "
            "each (it must divide the KV heads, or be a multiple of them that divides each group)"
        )
    if arch.intermediate_size < tp or arch.vocab_size < tp:
        raise ValueError(f"tensor_parallel_size: {tp} is larger than the model's dimensions")


def max_local_kv_heads(arch: ModelArch, tp: int) -> int:
    """The most KV heads any rank holds: it sizes every rank's KV pool (same block count)."""
    return max(head_shard(arch.num_heads, arch.num_kv_heads, tp, r).num_kv for r in range(tp))


def even_shard(total: int, tp: int, rank: int) -> tuple[int, int]:
    """(start, stop) of this rank's run of an evenly split dimension (MLP, vocabulary)."""
    start, n = _even_run(total, tp, rank)
    return start, start + n
