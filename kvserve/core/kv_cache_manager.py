"""Maps requests to KV blocks: reuses cached prefixes, grows block tables as tokens arrive,
registers full blocks in the prefix cache, and frees everything when a request ends.

Prefix caching: each full block of a request is identified by a hash chained over its
parent's hash, its token ids and the request's cache scope (an optional `cache_salt`). A new
request reuses the longest run of cached blocks at its start; at most num_tokens - 1 tokens
come from the cache, so the last token is always computed (it produces the next token's
logits). With prefix caching off, only the n samples of one request share blocks with each
other (their scope is their group id).

Copy-on-write: `fork` gives a new request references to all of another's blocks (beam search
forks a beam this way). Before a request writes into a block someone else also holds, it gets
a fresh block of its own; if the shared block holds computed tokens (the partly filled last
block), the copy (source, destination) is queued in `pending_copies`, and the workers copy
that block's KV before the step's forward pass (worker/model_runner.py). The first of two
sharers to write pays the copy; the other then holds the block alone and writes in place.
"""

from __future__ import annotations

from kvserve.core.block_pool import BlockHash, BlockPool, hash_block
from kvserve.request import Request

_NO_CACHE = object()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}  # hashes of a request's full blocks so far
        self._num_registered: dict[str, int] = {}  # how many of its blocks are in the cache
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) blocks to copy before the next forward
        self.replaced_tables: set[str] = set()  # requests whose tables changed in place (copy-on-write)
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _scope(self, request: Request):
        if self.enable_prefix_caching:
            return request.cache_salt
        return request.group_id if request.group_id is not None else _NO_CACHE

    def _block_hashes(self, request: Request, num_tokens: int) -> list[BlockHash]:
        """Hashes of the request's full blocks among its first num_tokens tokens (memoized)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        bs, scope = self.block_size, self._scope(request)
        tokens = request.all_token_ids
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs], scope))
        return hashes[: num_tokens // bs]

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Cached blocks holding the longest cached prefix of the request (may be empty)."""
        if self._scope(request) is _NO_CACHE or request.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        hits = []
        for h in self._block_hashes(request, request.num_tokens - 1):
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[int] = (),
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens after the request's computed ones (and
        after `computed_blocks`, cache hits for a request that holds no blocks yet), plus
        `num_lookahead_tokens` speculative slots after them. Lookahead slots may hold
        rejected tokens' KV, so blocks are registered in the prefix cache only up to the
        known tokens. Returns False, changing nothing, if the pool is short."""
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_cached = len(computed_blocks) * self.block_size
        total = request.num_computed_tokens + num_cached + num_new_tokens
        need = self.blocks_needed(total + num_lookahead_tokens) - len(blocks) - len(computed_blocks)
        first_write = request.num_computed_tokens // self.block_size
        shared = [i for i in range(first_write, len(blocks)) if self.pool.ref_cnt[blocks[i]] > 1]
        reclaimed = sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)  # leave the free queue
        if max(need, 0) + len(shared) > self.pool.num_free_blocks - reclaimed:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return False
        if shared:
            self._copy_on_write(request, blocks, shared)
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        self._register_full_blocks(request, blocks, total)
        return True

    def allocate_for_remote(self, request: Request, hits: list[int], num_tokens: int, headroom: int) -> bool:
        """Blocks for the first `num_tokens` tokens of a waiting request whose KV another engine
        will supply (after the cache hits `hits`). Nothing is registered in the prefix cache
        until the bytes are written (`commit_remote`): no other request may hit a block that
        is still empty. Leaves `headroom` blocks free for the running requests' growth."""
        need = self.blocks_needed(num_tokens) - len(hits)
        reclaimed = sum(1 for b in hits if self.pool.ref_cnt[b] == 0)
        if need + headroom > self.pool.num_free_blocks - reclaimed:
            return False
        self.pool.touch(hits)
        self.req_to_blocks[request.request_id] = list(hits) + self.pool.allocate(need)
        return True

    def commit_remote(self, request: Request) -> None:
        """The remote blocks are written: register the full ones up to the computed tokens."""
        blocks = self.req_to_blocks[request.request_id]
        self._register_full_blocks(request, blocks, request.num_computed_tokens)

    def detach(self, request: Request) -> list[int]:
        """Forget a finished request's blocks without freeing them (a producer's lease frees
        them later with `free_blocks`)."""
        self._num_registered.pop(request.request_id, None)
        self._hashes.pop(request.request_id, None)
        return self.req_to_blocks.pop(request.request_id, [])

    def free_blocks(self, blocks: list[int]) -> None:
        self.pool.free(blocks[::-1])  # tail first, as `free`

    def _copy_on_write(self, request: Request, blocks: list[int], indices: list[int]) -> None:
        """Give the request its own block at each of these table indices (all at or after its
        first unwritten position). Only the block holding computed tokens needs its KV copied;
        later ones hold nothing anyone reads yet."""
        fresh = self.pool.allocate(len(indices))
        for i, new in zip(indices, fresh):
            old = blocks[i]
            if i * self.block_size < request.num_computed_tokens:
                self.pending_copies.append((old, new))
            blocks[i] = new
            self.pool.free([old])
        self.replaced_tables.add(request.request_id)

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent (same tokens so far): one more reference
        each, no copy; whichever writes into a shared block first copies it (allocate_slots)."""
        blocks = list(self.req_to_blocks.get(parent.request_id, []))
        self.pool.touch(blocks)
        self.req_to_blocks[child.request_id] = blocks
        self._hashes[child.request_id] = list(self._hashes.get(parent.request_id, []))
        self._num_registered[child.request_id] = self._num_registered.get(parent.request_id, 0)

    def take_copies(self) -> tuple[list[tuple[int, int]], set[str]]:
        """The block copies the workers must make before the next forward, and the requests
        whose block tables changed in place since the last call."""
        copies, replaced = self.pending_copies, self.replaced_tables
        self.pending_copies, self.replaced_tables = [], set()
        return copies, replaced

    def _register_full_blocks(self, request: Request, blocks: list[int], num_tokens: int) -> None:
        """Put blocks that are full once this step's tokens are written into the cache."""
        if self._scope(request) is _NO_CACHE:
            return
        done = self._num_registered.get(request.request_id, 0)
        full = num_tokens // self.block_size
        hashes = self._block_hashes(request, num_tokens)  # may hold more (from a lookup)
        for i in range(done, full):
            self.pool.cache(blocks[i], hashes[i])
        self._num_registered[request.request_id] = max(done, full)

    def drop_uncomputed(self, request: Request) -> list[int]:
        """Uncache the blocks registered for tokens a failed step did not compute (they were
        registered when the step was scheduled); returns them."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        keep = request.num_computed_tokens // self.block_size
        done = self._num_registered.get(request.request_id, 0)
        dropped = blocks[keep:done]
        for b in dropped:
            self.pool.uncache(b)
        if done > keep:
            self._num_registered[request.request_id] = keep
        return dropped

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
        self._hashes.pop(request.request_id, None)
        if blocks:
            # Tail first: a request's last blocks are the least likely to be shared, so they
            # are evicted first.
            self.pool.free(blocks[::-1])

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_cache()

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    def usage(self) -> float:
        return self.pool.usage()
