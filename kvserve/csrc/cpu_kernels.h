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
void kv_write_int8(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k_scales, torch::Tensor v_scales,
                   torch::Tensor k, torch::Tensor v, torch::Tensor slot_blocks, torch::Tensor slot_offsets,
                   bool round_trip);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor row_argmax(torch::Tensor x);
