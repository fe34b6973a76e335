// Paged attention for one query token per sequence (decode), on the CPU, reading keys and values
// straight from the block pool: no gather copy, and no padding to the longest sequence.
//
// Shapes (contiguous):
//   query        (B, H, D) float32  one query token per sequence
//   key_cache    (Hkv, N, bs, D)    the layer's paged keys, float32, bfloat16, int8 or float8 (e4m3fn);
//                                   value_cache alike
//   key_scales   (Hkv, N, bs)       float16, int8 caches only: one scale per token and head
//   block_tables (B, max_blocks)    int64 block ids per sequence
//   seq_lens     (B,)               int64 tokens to attend per sequence (its own included)
//   out          (B, H, D) float32
// Work is split over (sequence, kv head) pairs; each pair handles its G = H / Hkv query heads, so a
// key or value row is loaded once for the whole group (GQA). Softmax is exact: scores first, then
// max, exponentials and the weighted sum of values. Narrow caches are widened in registers; an int8
// row's scale multiplies its dot product (keys) or its softmax weight (values), once per row. A
// float8 byte is widened through a 256-entry table (exact: every e4m3fn value is a float32 value).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

#include "kernels.h"

namespace {

// Blocks of a sequence are scattered through the pool, so the hardware prefetcher restarts at every
// block; asking for the next block while the current one is processed hides that latency.
inline void prefetch_block(const void* block, int64_t bytes) {
  const char* p = static_cast<const char*>(block);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 1);
}

inline float widen(float v) { return v; }
inline float widen(int8_t v) { return static_cast<float>(v); }
inline float widen(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// float32 value of every float8 e4m3fn bit pattern, from c10's own conversion (the reference for
// widen_row, and its tail).
const std::array<float, 256> kFloat8Values = [] {
  std::array<float, 256> values{};
  for (int bits = 0; bits < 256; ++bits)
    values[bits] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(bits), c10::Float8_e4m3fn::from_bits()));
  return values;
}();

inline float widen(c10::Float8_e4m3fn v) { return kFloat8Values[v.x]; }

// One row of float8 e4m3fn values into float32, before the row is used by every query head of its
// group (a table lookup per value and head ran the attention at half int8's speed). Each byte's
// sign, exponent and mantissa are moved into the float16 fields: e4m3's exponent bias is 7 against
// float16's 15, so that float16 is the value / 256, subnormals included; the float16 instruction
// widens it and a multiply by 256 is exact. 0x7f/0xff, e4m3fn's NaNs, would read 480 and are set
// to NaN. Equal to kFloat8Values for every byte (tested).
inline void widen_row(const c10::Float8_e4m3fn* src, float* dst, int64_t dim) {
  int64_t d = 0;
#if defined(__AVX2__) && defined(__F16C__)
  const __m128i sign_bit = _mm_set1_epi16(0x80), magnitude = _mm_set1_epi16(0x7f);
  const __m256 unbias = _mm256_set1_ps(256.f);
  const __m256 nan = _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN());
  for (; d + 8 <= dim; d += 8) {
    const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + d)));
    const __m128i mag = _mm_and_si128(x, magnitude);
    const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(x, sign_bit), 8), _mm_slli_epi16(mag, 7));
    const __m256 value = _mm256_mul_ps(_mm256_cvtph_ps(half), unbias);
    const __m256 is_nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, magnitude)));
    _mm256_storeu_ps(dst + d, _mm256_blendv_ps(value, nan, is_nan));
  }
#endif
  for (; d < dim; ++d) dst[d] = kFloat8Values[src[d].x];
}

// e4m3fn's largest finite value: the cache stores a larger magnitude as this (kv_cache.py clamps
// the same way before PyTorch's conversion, whose own overflow handling differs between versions).
constexpr float kFloat8Max = 448.f;

template <typename T>
void decode_attention_impl(const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache,
                           const c10::Half* key_scales, const c10::Half* value_scales,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                           at::Tensor& out) {
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = key_cache.size(0), num_blocks = key_cache.size(1);
  const int64_t block_size = key_cache.size(2), max_blocks = block_tables.size(1);
  const int64_t group = heads / kv_heads;
  const int64_t head_slots = num_blocks * block_size;
  const float* q = query.data_ptr<float>();
  const T* kc = static_cast<const T*>(key_cache.data_ptr());
  const T* vc = static_cast<const T*>(value_cache.data_ptr());
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const int64_t block_bytes = block_size * dim * static_cast<int64_t>(sizeof(T));
  // float8 rows are widened once into `row` and read from there by the group's query heads.
  constexpr bool kWidenRows = std::is_same_v<T, c10::Float8_e4m3fn>;

  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(group * dim);
    std::vector<float> row(kWidenRows ? dim : 0);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / kv_heads, kvh = pair % kv_heads;
      const int64_t len = lens[b];
      TORCH_CHECK(len > 0 && (len + block_size - 1) / block_size <= max_blocks, "seq_lens out of range");
      const float* qg = q + (b * heads + kvh * group) * dim;  // (G, D) queries of this group
      const T* k_head = kc + kvh * head_slots * dim;
      const T* v_head = vc + kvh * head_slots * dim;
      const c10::Half* ks_head = key_scales ? key_scales + kvh * head_slots : nullptr;
      const c10::Half* vs_head = value_scales ? value_scales + kvh * head_slots : nullptr;
      const int64_t* table = tables + b * max_blocks;
      scores.assign(group * len, 0.f);
      const int64_t used_blocks = (len + block_size - 1) / block_size;
      // Pass 1: scores (G, len), block by block (a block of one head is contiguous in memory).
      for (int64_t blk = 0; blk < used_blocks; ++blk) {
        TORCH_CHECK(table[blk] >= 0 && table[blk] < num_blocks, "block id out of range");
        const T* kb = k_head + table[blk] * block_size * dim;
        if (blk + 1 < used_blocks) prefetch_block(k_head + table[blk + 1] * block_size * dim, block_bytes);
        const int64_t first = blk * block_size;
        const int64_t count = std::min(block_size, len - first);
        for (int64_t j = 0; j < count; ++j) {
          const T* k = kb + j * dim;
          const float row_scale =
              fscale * (ks_head ? static_cast<float>(ks_head[table[blk] * block_size + j]) : 1.f);
          if constexpr (kWidenRows) widen_row(k, row.data(), dim);
          for (int64_t g = 0; g < group; ++g) {
            const float* qv = qg + g * dim;
            float dot = 0.f;
            if constexpr (kWidenRows) {
              const float* kf = row.data();
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < dim; ++d) dot += qv[d] * kf[d];
            } else {
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < dim; ++d) dot += qv[d] * widen(k[d]);
            }
            scores[g * len + first + j] = dot * row_scale;
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
        const T* vb = v_head + table[blk] * block_size * dim;
        if (blk + 1 < used_blocks) prefetch_block(v_head + table[blk + 1] * block_size * dim, block_bytes);
        const int64_t first = blk * block_size;
        const int64_t count = std::min(block_size, len - first);
        for (int64_t j = 0; j < count; ++j) {
          const T* v = vb + j * dim;
          const float row_scale = vs_head ? static_cast<float>(vs_head[table[blk] * block_size + j]) : 1.f;
          if constexpr (kWidenRows) widen_row(v, row.data(), dim);
          for (int64_t g = 0; g < group; ++g) {
            const float w = scores[g * len + first + j] * row_scale;
            float* a = acc.data() + g * dim;
            if constexpr (kWidenRows) {
              const float* vf = row.data();
#pragma omp simd
              for (int64_t d = 0; d < dim; ++d) a[d] += w * vf[d];
            } else {
#pragma omp simd
              for (int64_t d = 0; d < dim; ++d) a[d] += w * widen(v[d]);
            }
          }
        }
      }
      float* og = o + (b * heads + kvh * group) * dim;
      std::copy(acc.begin(), acc.end(), og);
    }
  });
}

const c10::Half* scales_of(const at::Tensor& cache, const c10::optional<at::Tensor>& scales,
                           const char* name) {
  if (cache.scalar_type() != at::kChar) return nullptr;
  TORCH_CHECK(scales.has_value() && scales->defined() && scales->scalar_type() == at::kHalf &&
                  scales->is_contiguous() && scales->numel() * cache.size(-1) == cache.numel(),
              name, ": an int8 cache needs float16 scales, one per token and head");
  return scales->data_ptr<c10::Half>();
}

}  // namespace

namespace kvik {

void decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                      at::Tensor& out, const c10::optional<at::Tensor>& key_scales,
                      const c10::optional<at::Tensor>& value_scales) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "float32 queries");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous() &&
              block_tables.is_contiguous() && seq_lens.is_contiguous() && out.is_contiguous(),
              "inputs must be contiguous");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "keys and values share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block tables and lengths are int64");
  TORCH_CHECK(query.size(1) % key_cache.size(0) == 0 && query.size(2) == key_cache.size(3),
              "query heads must be a multiple of the cache's, with the same head_dim");
  const c10::Half* ks = scales_of(key_cache, key_scales, "key_scales");
  const c10::Half* vs = scales_of(value_cache, value_scales, "value_scales");
  switch (key_cache.scalar_type()) {
    case at::kFloat:
      return decode_attention_impl<float>(query, key_cache, value_cache, nullptr, nullptr, block_tables,
                                          seq_lens, scale, out);
    case at::kBFloat16:
      return decode_attention_impl<c10::BFloat16>(query, key_cache, value_cache, nullptr, nullptr,
                                                  block_tables, seq_lens, scale, out);
    case at::kChar:
      return decode_attention_impl<int8_t>(query, key_cache, value_cache, ks, vs, block_tables, seq_lens,
                                           scale, out);
    case at::ScalarType::Float8_e4m3fn:
      return decode_attention_impl<c10::Float8_e4m3fn>(query, key_cache, value_cache, nullptr, nullptr,
                                                       block_tables, seq_lens, scale, out);
    default:
      TORCH_CHECK(false, "KV cache dtype must be float32, bfloat16, int8 or float8_e4m3fn, got ",
                  key_cache.scalar_type());
  }
}

void write_kv(const at::Tensor& source, at::Tensor& cache, const c10::optional<at::Tensor>& scales,
              const at::Tensor& slots) {
  TORCH_CHECK(source.scalar_type() == at::kFloat && source.dim() == 3 && source.stride(2) == 1,
              "source must be float32 (tokens, kv_heads, head_dim) with contiguous rows");
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous() && cache.size(0) == source.size(1) &&
                  cache.size(3) == source.size(2),
              "cache must be a contiguous (kv_heads, blocks, block_size, head_dim) tensor");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == source.size(0),
              "one int64 slot per token");
  const int64_t tokens = source.size(0), kv_heads = source.size(1), dim = source.size(2);
  const int64_t head_slots = cache.size(1) * cache.size(2);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* src = source.data_ptr<float>();
  c10::Half* scale_out = scales_of(cache, scales, "scales") ? scales->data_ptr<c10::Half>() : nullptr;
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < head_slots, "cache slot out of range");
    for (int64_t h = 0; h < kv_heads; ++h) {
      const float* row = src + t * source.stride(0) + h * source.stride(1);
      const int64_t at = h * head_slots + slot[t];
      switch (cache.scalar_type()) {
        case at::kFloat:
          std::memcpy(cache.data_ptr<float>() + at * dim, row, dim * sizeof(float));
          break;
        case at::kBFloat16: {
          c10::BFloat16* dst = cache.data_ptr<c10::BFloat16>() + at * dim;
          for (int64_t d = 0; d < dim; ++d) dst[d] = c10::BFloat16(row[d]);  // round to nearest even
          break;
        }
        case at::kChar: {
          // The same arithmetic as the PyTorch path (kvik.model.layers.kv_cache.quantize_kv):
          // scale = float16(amax / 127), values = round(x * (1 / scale)) clamped to [-127, 127].
          float amax = 0.f;
          for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(row[d]));
          const c10::Half stored(amax * (1.f / 127.f));
          const float row_scale = static_cast<float>(stored);
          const float inverse = row_scale > 0.f ? 1.f / row_scale : 0.f;
          int8_t* dst = cache.data_ptr<int8_t>() + at * dim;
          for (int64_t d = 0; d < dim; ++d) {
            const float v = std::nearbyint(row[d] * inverse);
            dst[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
          }
          scale_out[at] = stored;
          break;
        }
        case at::ScalarType::Float8_e4m3fn: {
          // Saturated to +-448, then c10's round-to-nearest-even conversion (PyTorch's own).
          c10::Float8_e4m3fn* dst = cache.data_ptr<c10::Float8_e4m3fn>() + at * dim;
          for (int64_t d = 0; d < dim; ++d)
            dst[d] = c10::Float8_e4m3fn(std::min(kFloat8Max, std::max(-kFloat8Max, row[d])));
          break;
        }
        default:
          TORCH_CHECK(false, "KV cache dtype must be float32, bfloat16, int8 or float8_e4m3fn, got ",
                      cache.scalar_type());
      }
    }
  }
}

}  // namespace kvik
