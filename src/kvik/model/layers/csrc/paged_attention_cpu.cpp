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
// key or value row is loaded once for the whole group (GQA). The plain loops: scores first, then
// max, exponentials and the weighted sum of values. With AVX-512 (attend_range_avx512), one pass over
// the blocks with the softmax kept online (running peak and total), the same result to float
// rounding; when the pairs do not divide evenly among the threads, each pair's blocks in ranges
// whose partial sums are merged (split-K, as flash-decoding does on GPUs).
// Narrow caches are widened in registers; an int8 row's scale multiplies its dot product (keys) or
// its softmax weight (values), once per row. A float8 byte is widened through a 256-entry table
// (exact: every e4m3fn value is a float32 value).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#if (defined(__AVX2__) && defined(__F16C__)) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "decode_team.h"
#include "kernels.h"

namespace {

std::atomic<bool> plain_attention{false};

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

#if defined(__AVX512F__)
// The AVX-512 pass for float32, bfloat16 and int8 caches with head_dim 16, 32, 64 or 128 (V = head_dim
// / 16 vectors a row). The plain loops below spend most of a decode's attention on two things: a
// horizontal sum per (token, query head) in the scores, and in the weighted sum of values an
// accumulator that goes to memory and back for every token. Here the scores of 16 tokens are summed
// together (sum16) and the accumulators stay in registers through a block: 2x the plain loops' speed
// from cache, and on the 125M reference model at ~330 tokens of context a decode step 4 % (float32
// cache) to 10 % (bfloat16) shorter.
template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
template <>
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// r[i] = the sum of v[i]'s 16 lanes, for 16 vectors: adjacent pairs within 128-bit lanes, then pairs
// of pairs, then across the four 128-bit lanes (about 30 instructions for 16 sums, against some 8
// for each one alone).
inline __m512 sum16(const __m512 (&v)[16]) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // b[i]: in each 128-bit lane L, the lane's sums of v[4i..4i+3].
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// q . k without the scale, as V products summed lane-wise (the caller sums the lanes).
template <int V, typename T>
inline __m512 dot_lanes(const float* q, const T* k) {
  __m512 p = _mm512_mul_ps(_mm512_loadu_ps(q), load16(k));
  for (int c = 1; c < V; ++c) p = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), load16(k + 16 * c), p);
  return p;
}

// One block's scores: scores[g * stride + j] = q_g . k_j * fscale (* the row's scale, int8).
// (Widening a narrow block's keys once for all query heads instead of per head made no
// difference: from cache the pass is bound by the FMAs and the sums.)
template <int V, typename T>
void block_scores_avx512(const float* qg, int64_t group, const T* kb, int64_t count, const c10::Half* kscales,
                         float fscale, float* scores, int64_t stride) {
  constexpr int64_t dim = 16 * V;
  for (int64_t g = 0; g < group; ++g) {
    const float* q = qg + g * dim;
    float* s = scores + g * stride;
    int64_t j = 0;
    for (; j + 16 <= count; j += 16) {
      __m512 p[16];
      for (int t = 0; t < 16; ++t) p[t] = dot_lanes<V>(q, kb + (j + t) * dim);
      __m512 row_scale = _mm512_set1_ps(fscale);
      if (kscales)
        row_scale = _mm512_mul_ps(row_scale, _mm512_cvtph_ps(_mm256_loadu_si256(
                                                 reinterpret_cast<const __m256i*>(kscales + j))));
      _mm512_storeu_ps(s + j, _mm512_mul_ps(sum16(p), row_scale));
    }
    for (; j < count; ++j)
      s[j] = _mm512_reduce_add_ps(dot_lanes<V>(q, kb + j * dim)) * fscale *
             (kscales ? static_cast<float>(kscales[j]) : 1.f);
  }
}

// One block's values: acc[g] += w_gj * v_j (w: the softmax weight, times the row's scale for int8),
// for H query heads at once, their accumulators in registers through the block.
template <int V, int H, typename T>
void block_values_heads(const float* weights, int64_t stride, const T* vb, int64_t count,
                        const c10::Half* vscales, float* acc) {
  constexpr int64_t dim = 16 * V;
  __m512 a[H][V];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < V; ++c) a[h][c] = _mm512_loadu_ps(acc + h * dim + 16 * c);
  for (int64_t j = 0; j < count; ++j) {
    __m512 v[V];
    for (int c = 0; c < V; ++c) v[c] = load16(vb + j * dim + 16 * c);
    const float row_scale = vscales ? static_cast<float>(vscales[j]) : 1.f;
    for (int h = 0; h < H; ++h) {
      const __m512 w = _mm512_set1_ps(weights[h * stride + j] * row_scale);
      for (int c = 0; c < V; ++c) a[h][c] = _mm512_fmadd_ps(w, v[c], a[h][c]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < V; ++c) _mm512_storeu_ps(acc + h * dim + 16 * c, a[h][c]);
}

// The group's heads up to four at a time (two for head_dim 128): at most 16 accumulators.
template <int V, typename T>
void block_values_avx512(const float* weights, int64_t stride, int64_t group, const T* vb, int64_t count,
                         const c10::Half* vscales, float* acc) {
  constexpr int64_t dim = 16 * V;
  constexpr int64_t kHeads = V >= 8 ? 2 : 4;
  for (int64_t g = 0; g < group; g += kHeads) {
    const float* w = weights + g * stride;
    float* a = acc + g * dim;
    const int64_t heads = std::min(kHeads, group - g);
    if constexpr (kHeads == 2) {  // only the counts that can occur are compiled (4 x 8 would spill)
      if (heads == 1) block_values_heads<V, 1>(w, stride, vb, count, vscales, a);
      else block_values_heads<V, 2>(w, stride, vb, count, vscales, a);
    } else {
      switch (heads) {
        case 1: block_values_heads<V, 1>(w, stride, vb, count, vscales, a); break;
        case 2: block_values_heads<V, 2>(w, stride, vb, count, vscales, a); break;
        case 3: block_values_heads<V, 3>(w, stride, vb, count, vscales, a); break;
        default: block_values_heads<V, 4>(w, stride, vb, count, vscales, a); break;
      }
    }
  }
}

// Query heads per KV head the single pass takes (its running peaks and totals live on the stack).
constexpr int64_t kMaxGroup = 64;

// Blocks ahead whose keys and values are asked for while the current one is processed.
constexpr int64_t kBlocksAhead = 2;

// One (sequence, KV head) pair's blocks [first_block, last_block) in a single pass (softmax kept
// online: a running peak and total per query head, the accumulators rescaled when the peak rises),
// so a block's keys and values are read together and the next blocks' are on their way meanwhile.
// weights: group * block_size floats of scratch; peak, total: group floats; acc: group * dim. Leaves
// the range's unnormalised sum in acc (out = acc / total, or merged with the pair's other ranges).
template <int V, typename T>
void attend_range_avx512(const float* qg, int64_t group, const T* k_head, const T* v_head, const c10::Half* ks_head,
                         const c10::Half* vs_head, const int64_t* table, int64_t num_blocks, int64_t len,
                         int64_t block_size, int64_t first_block, int64_t last_block, float fscale,
                         float* weights, float* peak, float* total, float* acc) {
  constexpr int64_t dim = 16 * V;
  const int64_t block_elems = block_size * dim, block_bytes = block_elems * static_cast<int64_t>(sizeof(T));
  std::fill(peak, peak + group, std::numeric_limits<float>::lowest());
  std::fill(total, total + group, 0.f);
  std::fill(acc, acc + group * dim, 0.f);
  const auto ask = [&](int64_t blk) {
    const int64_t id = table[blk];
    if (id < 0 || id >= num_blocks) return;  // refused below, when its turn comes
    prefetch_block(k_head + id * block_elems, block_bytes);
    prefetch_block(v_head + id * block_elems, block_bytes);
  };
  for (int64_t blk = first_block; blk < std::min(first_block + kBlocksAhead, last_block); ++blk) ask(blk);
  for (int64_t blk = first_block; blk < last_block; ++blk) {
    const int64_t id = table[blk];
    TORCH_CHECK(id >= 0 && id < num_blocks, "block id out of range");
    if (blk + kBlocksAhead < last_block) ask(blk + kBlocksAhead);
    const int64_t count = std::min(block_size, len - blk * block_size);
    block_scores_avx512<V>(qg, group, k_head + id * block_elems, count, ks_head ? ks_head + id * block_size : nullptr,
                           fscale, weights, block_size);
    for (int64_t g = 0; g < group; ++g) {
      float* w = weights + g * block_size;
      __m512 high = _mm512_set1_ps(std::numeric_limits<float>::lowest());
      for (int64_t j = 0; j < count; j += 16) {
        const __mmask16 lanes = count - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (count - j)) - 1);
        high = _mm512_mask_max_ps(high, lanes, high, _mm512_maskz_loadu_ps(lanes, w + j));
      }
      const float next = std::max(peak[g], _mm512_reduce_max_ps(high));
      const float rescale = std::exp(peak[g] - next);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < count; ++j) {
        w[j] = std::exp(w[j] - next);
        sum += w[j];
      }
      total[g] = total[g] * rescale + sum;
      peak[g] = next;
      if (rescale != 1.f) {
        const __m512 factor = _mm512_set1_ps(rescale);
        for (int c = 0; c < V; ++c)
          _mm512_storeu_ps(acc + g * dim + 16 * c, _mm512_mul_ps(factor, _mm512_loadu_ps(acc + g * dim + 16 * c)));
      }
    }
    block_values_avx512<V>(weights, block_size, group, v_head + id * block_elems, count,
                           vs_head ? vs_head + id * block_size : nullptr, acc);
  }
}

// out (G, D) = the ranges' sums merged: each range's accumulators and total rescaled to the largest
// peak, then divided by the combined total. One range: out = acc / total.
void merge_ranges(int64_t ranges, int64_t group, int64_t dim, const float* peaks, const float* totals,
                  const float* accs, float* out) {
  for (int64_t g = 0; g < group; ++g) {
    float top = std::numeric_limits<float>::lowest();
    for (int64_t r = 0; r < ranges; ++r) top = std::max(top, peaks[r * group + g]);
    float total = 0.f;
    float* o = out + g * dim;
    std::fill(o, o + dim, 0.f);
    for (int64_t r = 0; r < ranges; ++r) {
      if (totals[r * group + g] == 0.f) continue;  // an empty range
      const float factor = std::exp(peaks[r * group + g] - top);
      total += factor * totals[r * group + g];
      const float* a = accs + (r * group + g) * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) o[d] += factor * a[d];
    }
    const float inverse = 1.f / total;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) o[d] *= inverse;
  }
}
#endif

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
  // The AVX-512 pass's vectors per row (head_dim / 16), or 0 for the plain loops: float8 rows are
  // widened once for the group and read by the plain loops.
  int64_t vectors = 0;
#if defined(__AVX512F__)
  if (!kWidenRows && !plain_attention.load(std::memory_order_relaxed) &&
      (dim == 16 || dim == 32 || dim == 64 || dim == 128) && group <= kMaxGroup)
    vectors = dim / 16;
  if constexpr (!kWidenRows) {
    if (vectors) {
      for (int64_t b = 0; b < batch; ++b)
        TORCH_CHECK(lens[b] > 0 && (lens[b] + block_size - 1) / block_size <= max_blocks, "seq_lens out of range");
      // Work is (sequence, KV head) pairs; when they do not divide evenly among the threads (one
      // sequence of a model with 3 KV heads on 2 threads: one thread takes two, the step waits for
      // it), each pair's blocks are cut into `ranges` ranges that do, merged afterwards.
      const int64_t pairs = batch * kv_heads, threads = kvik::parallel_threads();
      const int64_t ranges = threads > 1 && pairs % threads != 0 ? threads / std::gcd(pairs, threads) : 1;
      const auto attend = [vectors](auto... args) {
        switch (vectors) {
          case 1: return attend_range_avx512<1, T>(args...);
          case 2: return attend_range_avx512<2, T>(args...);
          case 4: return attend_range_avx512<4, T>(args...);
          default: return attend_range_avx512<8, T>(args...);
        }
      };
      std::vector<float> partial(ranges > 1 ? pairs * ranges * group * (dim + 2) : 0);
      float* const peaks = partial.data();
      float* const totals = peaks + pairs * ranges * group;
      float* const accs = totals + pairs * ranges * group;
      kvik::parallel_for(0, pairs * ranges, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> weights(group * block_size), own(ranges > 1 ? 0 : group * (dim + 2));
        for (int64_t item = begin; item < end; ++item) {
          const int64_t pair = item / ranges, range = item % ranges;
          const int64_t b = pair / kv_heads, kvh = pair % kv_heads, len = lens[b];
          const int64_t used = (len + block_size - 1) / block_size;
          float* peak = ranges > 1 ? peaks + item * group : own.data();
          float* total = ranges > 1 ? totals + item * group : peak + group;
          float* acc = ranges > 1 ? accs + item * group * dim : total + group;
          attend(q + (b * heads + kvh * group) * dim, group, kc + kvh * head_slots * dim, vc + kvh * head_slots * dim,
                 key_scales ? key_scales + kvh * head_slots : nullptr,
                 value_scales ? value_scales + kvh * head_slots : nullptr, tables + b * max_blocks, num_blocks, len,
                 block_size, used * range / ranges, used * (range + 1) / ranges, fscale, weights.data(), peak, total,
                 acc);
          if (ranges == 1) merge_ranges(1, group, dim, peak, total, acc, o + (b * heads + kvh * group) * dim);
        }
      });
      if (ranges > 1)
        for (int64_t pair = 0; pair < pairs; ++pair) {
          const int64_t b = pair / kv_heads, kvh = pair % kv_heads, first = pair * ranges;
          merge_ranges(ranges, group, dim, peaks + first * group, totals + first * group, accs + first * group * dim,
                       o + (b * heads + kvh * group) * dim);
        }
      return;
    }
  }
#endif
  kvik::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
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

void set_plain_attention(bool plain) { plain_attention.store(plain); }

void write_kv(const at::Tensor& source, at::Tensor& cache, const c10::optional<at::Tensor>& scales,
              const at::Tensor& slots) {
  TORCH_CHECK(source.scalar_type() == at::kFloat && source.dim() == 3 && source.stride(2) == 1,
              "source must be float32 (tokens, kv_heads, head_dim) with contiguous rows");
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous() && cache.size(0) == source.size(1) &&
                  cache.size(3) == source.size(2),
              "cache must be a contiguous (kv_heads, blocks, block_size, head_dim) tensor");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == source.size(0),
              "one int64 slot per token");
  c10::Half* scale_out = scales_of(cache, scales, "scales") ? scales->data_ptr<c10::Half>() : nullptr;
  write_kv_rows(source.data_ptr<float>(), source.size(0), source.stride(0), source.stride(1), cache.data_ptr(),
                cache.scalar_type(), cache.size(0), cache.size(1) * cache.size(2), cache.size(3), scale_out,
                slots.data_ptr<int64_t>());
}

void write_kv_rows(const float* src, int64_t tokens, int64_t token_stride, int64_t head_stride, void* cache,
                   at::ScalarType dtype, int64_t kv_heads, int64_t head_slots, int64_t dim, c10::Half* scale_out,
                   const int64_t* slot) {
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < head_slots, "cache slot out of range");
    for (int64_t h = 0; h < kv_heads; ++h) {
      const float* row = src + t * token_stride + h * head_stride;
      const int64_t at = h * head_slots + slot[t];
      switch (dtype) {
        case at::kFloat:
          std::memcpy(static_cast<float*>(cache) + at * dim, row, dim * sizeof(float));
          break;
        case at::kBFloat16: {
          c10::BFloat16* dst = static_cast<c10::BFloat16*>(cache) + at * dim;
          for (int64_t d = 0; d < dim; ++d) dst[d] = c10::BFloat16(row[d]);  // round to nearest even
          break;
        }
        case at::kChar: {
          // The same arithmetic as the PyTorch path (kvik.model.layers.kv_cache.quantize_kv):
          // scale = float16(amax / 127), values = round(x * (1 / scale)) clamped to [-127, 127].
          TORCH_CHECK(scale_out != nullptr, "an int8 cache needs its scales");
          float amax = 0.f;
          for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(row[d]));
          const c10::Half stored(amax * (1.f / 127.f));
          const float row_scale = static_cast<float>(stored);
          const float inverse = row_scale > 0.f ? 1.f / row_scale : 0.f;
          int8_t* dst = static_cast<int8_t*>(cache) + at * dim;
          for (int64_t d = 0; d < dim; ++d) {
            const float v = std::nearbyint(row[d] * inverse);
            dst[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
          }
          scale_out[at] = stored;
          break;
        }
        case at::ScalarType::Float8_e4m3fn: {
          // Saturated to +-448, then c10's round-to-nearest-even conversion (PyTorch's own).
          c10::Float8_e4m3fn* dst = static_cast<c10::Float8_e4m3fn*>(cache) + at * dim;
          for (int64_t d = 0; d < dim; ++d)
            dst[d] = c10::Float8_e4m3fn(std::min(kFloat8Max, std::max(-kFloat8Max, row[d])));
          break;
        }
        default:
          TORCH_CHECK(false, "KV cache dtype must be float32, bfloat16, int8 or float8_e4m3fn, got ", dtype);
      }
    }
  }
}

}  // namespace kvik
