// Paged attention for one query token per sequence (decode), on the CPU, reading keys and values
// straight from the block pool: no gather copy, and no padding to the longest sequence.
//
// Shapes (float32, contiguous):
//   query        (B, H, D)          one query token per sequence
//   key_cache    (Hkv, N, bs, D)    the layer's paged keys; value_cache the same
//   block_tables (B, max_blocks)    int64 block ids per sequence
//   seq_lens     (B,)               int64 tokens to attend per sequence (its own included)
//   out          (B, H, D)
// Work is split over (sequence, kv head) pairs; each pair handles its G = H / Hkv query heads, so a
// key or value row is loaded once for the whole group (GQA). Softmax is exact: scores first, then
// max, exponentials and the weighted sum of values.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"

namespace {

// Blocks of a sequence are scattered through the pool, so the hardware prefetcher restarts at every
// block; asking for the next block while the current one is processed hides that latency.
inline void prefetch_block(const float* block, int64_t floats) {
  for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(block + i, 0, 1);
}

}  // namespace

namespace kvik {

void decode_attention(const torch::Tensor& query, const torch::Tensor& key_cache,
                      const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                      const torch::Tensor& seq_lens, double scale, torch::Tensor& out) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32, "float32 only");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous() &&
              block_tables.is_contiguous() && seq_lens.is_contiguous() && out.is_contiguous(),
              "inputs must be contiguous");
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = key_cache.size(0), num_blocks = key_cache.size(1);
  const int64_t block_size = key_cache.size(2), max_blocks = block_tables.size(1);
  const int64_t group = heads / kv_heads;
  const float* q = query.data_ptr<float>();
  const float* kc = key_cache.data_ptr<float>();
  const float* vc = value_cache.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(group * dim);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / kv_heads, kvh = pair % kv_heads;
      const int64_t len = lens[b];
      const float* qg = q + (b * heads + kvh * group) * dim;  // (G, D) queries of this group
      const float* k_head = kc + kvh * num_blocks * block_size * dim;
      const float* v_head = vc + kvh * num_blocks * block_size * dim;
      const int64_t* table = tables + b * max_blocks;
      scores.assign(group * len, 0.f);
      const int64_t used_blocks = (len + block_size - 1) / block_size;
      // Pass 1: scores (G, len), block by block (a block of one head is contiguous in memory).
      for (int64_t blk = 0; blk < used_blocks; ++blk) {
        const float* kb = k_head + table[blk] * block_size * dim;
        if (blk + 1 < used_blocks) prefetch_block(k_head + table[blk + 1] * block_size * dim, block_size * dim);
        const int64_t first = blk * block_size;
        const int64_t count = std::min(block_size, len - first);
        for (int64_t j = 0; j < count; ++j) {
          const float* k = kb + j * dim;
          for (int64_t g = 0; g < group; ++g) {
            const float* qv = qg + g * dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < dim; ++d) dot += qv[d] * k[d];
            scores[g * len + first + j] = dot * fscale;
          }
        }
      }
      // Softmax per query head.
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        float peak = s[0];
#pragma omp simd reduction(max : peak)
        for (int64_t t = 1; t < len; ++t) peak = std::max(peak, s[t]);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; ++t) {
          s[t] = std::exp(s[t] - peak);
          total += s[t];
        }
        const float inv = 1.f / total;
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      // Pass 2: weighted sum of value rows, block by block.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t blk = 0; blk < used_blocks; ++blk) {
        const float* vb = v_head + table[blk] * block_size * dim;
        if (blk + 1 < used_blocks) prefetch_block(v_head + table[blk + 1] * block_size * dim, block_size * dim);
        const int64_t first = blk * block_size;
        const int64_t count = std::min(block_size, len - first);
        for (int64_t j = 0; j < count; ++j) {
          const float* v = vb + j * dim;
          for (int64_t g = 0; g < group; ++g) {
            const float w = scores[g * len + first + j];
            float* a = acc.data() + g * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) a[d] += w * v[d];
          }
        }
      }
      float* og = o + (b * heads + kvh * group) * dim;
      std::copy(acc.begin(), acc.end(), og);
    }
  });
}

}  // namespace kvik

void register_fused_ops(pybind11::module& m);  // fused_ops_cpu.cpp
void register_gemv(pybind11::module& m);       // gemv_cpu.cpp
void register_decode_stack(pybind11::module& m);  // decode_stack_cpu.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &kvik::decode_attention, "paged decode attention (CPU, float32)");
  register_fused_ops(m);
  register_gemv(m);
  register_decode_stack(m);
}
