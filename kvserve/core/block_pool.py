"""The pool of physical KV blocks: a free queue and reference counts.

Blocks are ids into the preallocated KV tensor. A block is in use while its reference
count is > 0; requests that share content (later: prefix caching, parallel sampling) each
hold a reference. Freed blocks go to the back of the free queue.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_cnt[b] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            assert self.ref_cnt[b] > 0, f"block {b} is free"
            self.ref_cnt[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero become free."""
        for b in blocks:
            assert self.ref_cnt[b] > 0, f"double free of block {b}"
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free.append(b)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks
