"""Numbers and arithmetic shared by the kernels and by code that must not import triton
(CUDA graphs' buffers, memory estimates)."""

DECODE_TOKENS_PER_SPLIT = 256  # a decode split below this reads too little to pay for its partial output
DECODE_MAX_SPLITS = 16


def num_decode_splits(table_width: int, block_size: int) -> int:
    """Split-K count for decode over a block table `table_width` blocks wide: one split per
    DECODE_TOKENS_PER_SPLIT tokens, at most DECODE_MAX_SPLITS. A shape, not the data, decides it,
    so a captured CUDA graph replays the same launch."""
    return max(1, min(DECODE_MAX_SPLITS, -(-table_width * block_size // DECODE_TOKENS_PER_SPLIT)))
