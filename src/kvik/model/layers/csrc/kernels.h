// kvik's CPU kernels (float32), callable from each other's translation units: the decode stack
// (decode_stack_cpu.cpp) chains them without returning to Python between layers.
#pragma once

#include <torch/extension.h>

namespace kvik {

// fused_ops_cpu.cpp
void rms_norm(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight, double eps);
void fused_add_rms_norm(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight, double eps);
void rotary_inplace(torch::Tensor& qk, const torch::Tensor& cos, const torch::Tensor& sin);
void silu_and_mul(torch::Tensor& out, const torch::Tensor& gate_up);

// paged_attention_cpu.cpp
void decode_attention(const torch::Tensor& query, const torch::Tensor& key_cache,
                      const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                      const torch::Tensor& seq_lens, double scale, torch::Tensor& out);

// gemv_cpu.cpp
torch::Tensor gemv_packed(const torch::Tensor& x, int64_t weight_address, int64_t out_features,
                          int64_t in_stride, int64_t block, const c10::optional<torch::Tensor>& bias);

}  // namespace kvik
