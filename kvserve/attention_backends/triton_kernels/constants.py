"""Numbers shared by the kernels and by code that must not import triton (memory estimates)."""

DECODE_TOKENS_PER_SPLIT = 256  # a decode split below this reads too little to pay for its partial output
DECODE_MAX_SPLITS = 16
