"""The CPU kernels QuantizedLinear uses where PyTorch's weight-only kernels are slow, on
machines where kvserve's own kernels (csrc/quant_matmul_cpu.cpp) are not built.

`aten._weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu` read few bytes (fast for one row,
where decode is bandwidth-bound) but were 1.3-2.5x slower than the fp32 oneDNN matmul from 8
rows on (benchmarks/bench_quant_kernels.py, docs/BENCHMARKS.md "Batched quantized speed").
What was measured instead, and chosen:
- PyTorch's dynamic quantized linear (`quantized::linear_dynamic`, fbgemm / oneDNN under the
  `x86` engine: u8 x s8 dot products with VNNI / AMX) was the fastest kernel at every row
  count, 1 to 128, 2-3x fp32 at 32 rows. It quantizes the activations per call, so it is
  W8A8: with one scale per call it cost +46% perplexity (the first token's hidden state sets
  the scale for the whole chunk), with rows scaled to a common range first
  (`dynamic_int8_mm`) +4.0% for int8 weights and +3.2-3.9% for int4 weights. That fails int8's
  +2% gate and passes int4's +10% one, so:
- int8 keeps exact weight-only arithmetic: from `INT8_BF16_MIN_ROWS` rows its codes are
  widened to bf16 per call (exact: |q| <= 127) for oneDNN's bf16 matmul (AMX /
  avx512_bf16) and the per-row scale is applied to the output (`int8_bf16_mm`). No extra
  memory. Vocabulary-sized tables widen 28M codes per call, which only pays from
  `INT8_BF16_MIN_ROWS_LARGE` rows.
- int4 has no dynamic kernel for group-wise codes and dequantizing it per call cost 5-10x
  the fp32 matmul, so an int4 projection also holds an int8 copy of its weight (requantized
  per row from the int4 values at load) for the dynamic kernel from `INT4_DYNAMIC_MIN_ROWS`
  rows; one row (the bandwidth-bound single stream) reads half the bytes through the int4
  kernel. The price is memory: int4 then holds about 1.6 bytes per weight instead of 0.6.
  These crossovers come from one-thread CPU timings; end to end with two threads int4
  batches were still slower than fp32 (docs/BENCHMARKS.md): to be re-tuned.
Without VNNI the dynamic kernel's activations use 7 bits (`reduce_range`): AVX2's
`vpmaddubsw` would otherwise saturate its int16 sums. PyTorch 2.13 deprecates quantized
tensors; where they are gone `dynamic_int8_pack` returns None and the int4 kernel runs at
every row count.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.nn.functional as F

from kvserve.platform import cpu_isa as isa_mod

logger = logging.getLogger(__name__)

# Row counts from which each batched path runs (crossovers measured on AVX-512 + AMX against
# the weight-only kernels and fp32: docs/BENCHMARKS.md, "Batched quantized speed").
# int4 through the dynamic kernel (on an int8 copy) is off: the one-thread kernel timings
# favoured it from 2 rows, but end to end with two threads int4 batches ran at 0.13-0.73x
# fp32 through it against ~1.0x through the int4 kernel, for +1 byte per weight.
INT4_DYNAMIC_MIN_ROWS: int | None = None
# int8's bf16 widening is off: its bf16 outputs round a tensor-parallel rank's partial sum
# differently from the whole row's, and greedy TP=2 left TP=1 at a non-tie on the tiny model
# (tests/test_parallel.py, int8 weights). Measured when on: 1.11-1.51x fp32 end to end.
INT8_BF16_MIN_ROWS: int | None = None  # was 32
INT8_BF16_MIN_ROWS_LARGE: int | None = None  # was 64, for vocabulary-sized tables
LARGE_WEIGHT = 8 * 2**20  # elements: past the caches, widening per call costs memory traffic


def int8_bf16_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x @ (codes * scales).T: codes widened to bf16 (exact), scales applied to the output."""
    y = F.linear(x.to(torch.bfloat16), codes.to(torch.bfloat16))
    return y.float().mul_(scales.float())


def dynamic_int8_pack(codes: torch.Tensor, scales: torch.Tensor):
    """Packed params for `quantized::linear_dynamic` from symmetric per-row int8 codes, or
    None where the quantized engine is not available."""
    try:
        n = codes.shape[0]
        with warnings.catch_warnings():  # quantized tensors are deprecated; this falls back
            warnings.simplefilter("ignore", UserWarning)
            q = torch._make_per_channel_quantized_tensor(
                codes.contiguous(), scales.double(), torch.zeros(n, dtype=torch.long), 0
            )
        packed = torch.ops.quantized.linear_prepack(q, None)
        torch.ops.quantized.linear_dynamic(torch.zeros(1, codes.shape[1]), packed, True)
        return packed
    except (RuntimeError, AttributeError) as e:
        logger.info("dynamic int8 linear unavailable (%s); using the weight-only kernel", e)
        return None


def dynamic_int8_mm(x: torch.Tensor, packed) -> torch.Tensor:
    """x @ W.T in float32 through the dynamic quantized linear, with per-row activation scales.

    The kernel quantizes its input with one scale per call; over a prefill chunk that scale
    is set by the largest row (the first token's hidden state is many times the others'),
    which cost +46% perplexity. Dividing each row by its own max |x| first and multiplying the
    output row back (exact: the product is linear in each row) gives every row the full
    8-bit range, as per-token quantization would."""
    x = x.float()
    row_max = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    reduce_range = not isa_mod.cpu_isa().vnni
    y = torch.ops.quantized.linear_dynamic((x / row_max).contiguous(), packed, reduce_range)
    return y.mul_(row_max)
