"""Maps requests to KV blocks: grows block tables as tokens arrive, frees them on finish."""

from __future__ import annotations

from kvserve.core.block_pool import BlockPool
from kvserve.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens; False (and no change) if the pool is short."""
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(blocks)
        if need > self.pool.num_free_blocks:
            return False
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        return True

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks:
            # Free the tail first so, with prefix caching later, shared heads stay longest.
            self.pool.free(blocks[::-1])

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()
