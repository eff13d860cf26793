// The CPU kernels' entry points, for the bindings and for the decode stack that calls them
// directly (definitions in paged_attention_cpu.cpp, layer_ops_cpu.cpp and sampling_cpu.cpp).
#pragma once
#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor k_scale, torch::Tensor v_scale, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor w, double eps);
void rotary_inplace(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
void kv_write(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
              torch::Tensor slot_blocks, torch::Tensor slot_offsets);
void kv_write_codes(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k_scales, torch::Tensor v_scales,
                    torch::Tensor k, torch::Tensor v, torch::Tensor slot_blocks, torch::Tensor slot_offsets,
                    bool round_trip);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor row_argmax(torch::Tensor x);

// Float32 forms of the layer ops and the attention on raw buffers, one thread, no checks (and
// no allocation once the attention's buffers have grown), for the overlapped decode stack
// (decode_overlap_cpu.cpp): between two weight stages its thread 0 runs them with caches the
// weight stream has just emptied, where each ATen call's dispatch, allocation and checks cost
// microseconds. The tensor forms above call the same loops, so the results are the same bits.
namespace raw {
// x += delta (rows at strides sx, sd; delta may be null: RMSNorm alone), out = RMSNorm(x) * w
// (out's rows contiguous, d wide).
void add_rms_norm(float* x, int64_t sx, const float* delta, int64_t sd, const float* w, float* out, int64_t rows,
                  int64_t d, float eps);
// rotary_inplace of x [rows, heads, hd] at row / head strides sr, sh; cos/sin [rows, hd].
void rotary(float* x, int64_t rows, int64_t heads, int64_t hd, int64_t sr, int64_t sh, const float* cos,
            const float* sin);
// silu_mul of gate_up rows (stride sg) into out [rows, inter].
void silu_mul(const float* gate_up, int64_t sg, float* out, int64_t rows, int64_t inter);

// A step's new K/V rows: row t of n to block blk[t], offset off[t] of caches [blocks, kv_heads,
// block_size, head_dim] (the slots already checked: check_slots).
struct KvSlots {
  const int64_t* blk;
  const int64_t* off;
  int64_t n, kv_heads, block_size, head_dim;
};
// Raises unless every slot lies in caches of `blocks` blocks (what the writes below assume).
void check_slots(const KvSlots& slots, int64_t blocks);
// kv_write / kv_write_codes (without the round trip; fp8: float8_e4m3fn codes, else int8) of k
// and v rows at strides (sk0, sk1), (sv0, sv1).
void kv_write(float* k_cache, float* v_cache, const float* k, int64_t sk0, int64_t sk1, const float* v,
              int64_t sv0, int64_t sv1, const KvSlots& slots);
void kv_write_codes(void* k_cache, void* v_cache, bool fp8, at::BFloat16* k_scales, at::BFloat16* v_scales, float* k,
                    int64_t sk0, int64_t sk1, float* v, int64_t sv0, int64_t sv1, const KvSlots& slots);

// paged_decode_attention of float32 q rows (row stride q_stride) into out [seqs, heads,
// head_dim], a float32 cache or a 1-byte one with its scales (k_scales non-null: int8 codes, or
// float8_e4m3fn ones where fp8). Given a range,
// only work items [begin, end) (item = sequence * kv_heads + kv head: one KV head's group of
// query heads), each computed as a whole call computes it: threads may share one attention.
struct PagedDecode {
  const float* q;
  int64_t q_stride;
  float* out;
  const void *k_cache, *v_cache;  // [blocks, kv_heads, block_size, head_dim]
  const at::BFloat16 *k_scales, *v_scales;  // [blocks, kv_heads, block_size], or null: a float cache
  bool fp8;  // with scales: float8_e4m3fn codes (else int8)
  const int64_t* block_tables;  // [seqs, max_blocks]
  int64_t max_blocks;
  const int64_t* seq_lens;
  int64_t seqs, heads, kv_heads, block_size, head_dim;
  double scale;
};
void paged_decode_attention(const PagedDecode& a, int64_t begin = 0, int64_t end = -1);
}  // namespace raw
