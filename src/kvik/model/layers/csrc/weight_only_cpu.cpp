// Linear layers with bfloat16, int8 or int4 weights and float32 activations (CPU).
//
// Decoding a few sequences streams every weight once per step, so its speed is the weight bytes over
// the memory bandwidth: bfloat16 halves them, int8 quarters them, int4 (with its scales) brings them
// to about a sixth. The weights are widened to float32 in registers, right after they are loaded, and
// every product and sum is float32, so the only error is the weights' own rounding.
//
// Layout (kvik's own, built by kvik.model.quant.packing): blocks of 16 output rows; a block stores,
// for each input element k, the 16 weights of its rows side by side (input-major). One load then
// feeds 16 accumulators per row of x, with no horizontal sums, and each block is one sequential
// stream. int4 packs output rows j and j + 8 of a block into the low and high nibble of byte j;
// its scales (and offsets) are per group of `group` input elements and per row, float16.
//
// Instruction sets: the package ships sources, built with -march=native on the machine at first use
// (cpu_kernels.py), so the build sees the CPU it runs on. Where that CPU has AVX2, FMA and F16C
// (x86-64 since 2013-2015, AVX-512 CPUs included) the block kernels are written with AVX2
// intrinsics: 16 outputs are two 8-float registers, inputs are unrolled into independent
// accumulator chains so a single row is not bound by FMA latency. Everywhere else the same
// arithmetic runs as plain loops that GCC vectorises as it can. `set_portable_kernels(True)` runs
// the plain loops on an AVX2 machine too (tests compare both).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVIK_WEIGHT_ONLY_AVX2 1
#else
#define KVIK_WEIGHT_ONLY_AVX2 0
#endif

namespace {

std::atomic<bool> portable_only{false};

constexpr int kBlock = static_cast<int>(kvik::kWeightBlock);
constexpr int kRows = 4;  // rows of x per pass over a block of weights (accumulators in registers)

inline float bf16_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

// Each kernel adds one block's contribution for M rows of x: out[m][j] = sum_k W[j][k] x[m][k].

template <int M>
void block_bf16(const uint16_t* w, const float* x, int64_t x_stride, int64_t in_features,
                float (&out)[kRows][kBlock]) {
  float acc[M][kBlock] = {};
  for (int64_t k = 0; k < in_features; ++k) {
    const uint16_t* wk = w + k * kBlock;
    float wf[kBlock];
#pragma omp simd
    for (int j = 0; j < kBlock; ++j) wf[j] = bf16_to_float(wk[j]);
    for (int m = 0; m < M; ++m) {
      const float xv = x[m * x_stride + k];
#pragma omp simd
      for (int j = 0; j < kBlock; ++j) acc[m][j] += wf[j] * xv;
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < kBlock; ++j) out[m][j] = acc[m][j];
}

template <int M>
void block_int8(const int8_t* w, const float* scales, const float* x, int64_t x_stride, int64_t in_features,
                float (&out)[kRows][kBlock]) {
  float acc[M][kBlock] = {};
  for (int64_t k = 0; k < in_features; ++k) {
    const int8_t* wk = w + k * kBlock;
    float wf[kBlock];
#pragma omp simd
    for (int j = 0; j < kBlock; ++j) wf[j] = static_cast<float>(wk[j]);
    for (int m = 0; m < M; ++m) {
      const float xv = x[m * x_stride + k];
#pragma omp simd
      for (int j = 0; j < kBlock; ++j) acc[m][j] += wf[j] * xv;
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < kBlock; ++j) out[m][j] = acc[m][j] * scales[j];
}

// Per group the nibbles' products are summed unscaled; the group's scale and offset are applied
// once at its end: sum_k (u s + o) x_k = s sum_k u x_k + o sum_k x_k, with sum_k x_k precomputed
// per row and group (x_sums). Symmetric weights have o = -8 s.
template <int M, bool kOffsets>
void block_int4(const uint8_t* w, const c10::Half* scales, const c10::Half* offsets, const float* x,
                int64_t x_stride, const float* x_sums, int64_t groups, int64_t in_features, int64_t group,
                float (&out)[kRows][kBlock]) {
  constexpr int kHalf = kBlock / 2;
  float total[M][kBlock] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t first = g * group, last = std::min(in_features, first + group);
    float acc[M][kBlock] = {};
    for (int64_t k = first; k < last; ++k) {
      const uint8_t* wk = w + k * kHalf;
      float wf[kBlock];
#pragma omp simd
      for (int j = 0; j < kHalf; ++j) wf[j] = static_cast<float>(wk[j] & 15);
#pragma omp simd
      for (int j = 0; j < kHalf; ++j) wf[j + kHalf] = static_cast<float>(wk[j] >> 4);
      for (int m = 0; m < M; ++m) {
        const float xv = x[m * x_stride + k];
#pragma omp simd
        for (int j = 0; j < kBlock; ++j) acc[m][j] += wf[j] * xv;
      }
    }
    float scale[kBlock], offset[kBlock];
    for (int j = 0; j < kBlock; ++j) {
      scale[j] = static_cast<float>(scales[g * kBlock + j]);
      offset[j] = kOffsets ? static_cast<float>(offsets[g * kBlock + j]) : -8.f * scale[j];
    }
    for (int m = 0; m < M; ++m) {
      const float x_sum = x_sums[m * groups + g];
#pragma omp simd
      for (int j = 0; j < kBlock; ++j) total[m][j] += acc[m][j] * scale[j] + offset[j] * x_sum;
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < kBlock; ++j) out[m][j] = total[m][j];
}

#if KVIK_WEIGHT_ONLY_AVX2

// Widen the 16 weights of one input element: outputs 0-7 into lo, 8-15 into hi.
struct WidenBF16 {
  using Stored = uint16_t;
  static constexpr int kPerInput = 16;
  static inline void widen(const uint16_t* w, __m256& lo, __m256& hi) {
    const __m256i low = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    const __m256i high = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 8)));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(low, 16));
    hi = _mm256_castsi256_ps(_mm256_slli_epi32(high, 16));
  }
};

struct WidenInt8 {
  using Stored = int8_t;
  static constexpr int kPerInput = 16;
  static inline void widen(const int8_t* w, __m256& lo, __m256& hi) {
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 8))));
  }
};

struct WidenInt4 {  // byte j: output j in the low nibble, j + 8 in the high one
  using Stored = uint8_t;
  static constexpr int kPerInput = 8;
  static inline void widen(const uint8_t* w, __m256& lo, __m256& hi) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
  }
};

// Independent accumulator chains per row count: an FMA's result is ready after 4 cycles and two
// can start per cycle, so one row needs about eight chains in flight (16 outputs = 2 per input).
template <int M>
constexpr int kUnroll = M == 1 ? 4 : (M == 2 ? 2 : 1);
constexpr int kPrefetchBytes = 1024;

// U inputs at a time into U independent chains per row and half, summed at the end: acc[m] (or
// acc[m] += with kAdd) = sum over k in [first, first + count) of W[k][0..15] * x[m][k]; count is a
// multiple of U. The chains are one flat array with constant indices once the loops unroll, which
// GCC keeps in registers (a [U][M][2] array it kept on the stack, at a third of the speed).
template <typename Widen, int M, int U, bool kAdd>
__attribute__((always_inline)) inline void dot_chains(const typename Widen::Stored* w, const float* x,
                                                     int64_t x_stride, int64_t first, int64_t count,
                                                     __m256 (&acc)[M][2]) {
  __m256 part[U * M * 2];
  for (int i = 0; i < U * M * 2; ++i) part[i] = _mm256_setzero_ps();
  constexpr int kLines = (U * Widen::kPerInput * static_cast<int>(sizeof(typename Widen::Stored)) + 63) / 64;
  for (int64_t k = first; k < first + count; k += U) {
    // The weights are one sequential stream, but the hardware prefetcher stops at every 4 KiB page
    // and runs behind a loop that consumes so few bytes per cycle: asking for the bytes 1 KiB ahead
    // took int8 from 70 % to about 95 % of a plain read's speed on this machine (bf16 85 -> 100 %).
    for (int line = 0; line < kLines; ++line)
      __builtin_prefetch(reinterpret_cast<const char*>(w + k * Widen::kPerInput) + kPrefetchBytes + 64 * line,
                         0, 1);
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      __m256 lo, hi;
      Widen::widen(w + (k + u) * Widen::kPerInput, lo, hi);
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        const __m256 xv = _mm256_broadcast_ss(x + m * x_stride + k + u);
        part[(u * M + m) * 2] = _mm256_fmadd_ps(lo, xv, part[(u * M + m) * 2]);
        part[(u * M + m) * 2 + 1] = _mm256_fmadd_ps(hi, xv, part[(u * M + m) * 2 + 1]);
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    if (!kAdd) {
      acc[m][0] = part[m * 2];
      acc[m][1] = part[m * 2 + 1];
    }
    for (int u = kAdd ? 0 : 1; u < U; ++u) {
      acc[m][0] = _mm256_add_ps(acc[m][0], part[(u * M + m) * 2]);
      acc[m][1] = _mm256_add_ps(acc[m][1], part[(u * M + m) * 2 + 1]);
    }
  }
}

// acc[m] = sum over inputs k in [first, last) of W[k][0..15] * x[m][k].
template <typename Widen, int M>
inline void dot_avx2(const typename Widen::Stored* w, const float* x, int64_t x_stride, int64_t first,
                     int64_t last, __m256 (&acc)[M][2]) {
  constexpr int U = kUnroll<M>;
  const int64_t body = (last - first) / U * U;
  dot_chains<Widen, M, U, false>(w, x, x_stride, first, body, acc);
  if (body < last - first)
    dot_chains<Widen, M, 1, true>(w, x, x_stride, first + body, last - first - body, acc);
}

template <int M>
inline void store_rows(const __m256 (&acc)[M][2], float (&out)[kRows][kBlock]) {
  for (int m = 0; m < M; ++m) {
    _mm256_storeu_ps(out[m], acc[m][0]);
    _mm256_storeu_ps(out[m] + 8, acc[m][1]);
  }
}

template <int M>
void block_bf16_avx2(const uint16_t* w, const float* x, int64_t x_stride, int64_t in_features,
                     float (&out)[kRows][kBlock]) {
  __m256 acc[M][2];
  dot_avx2<WidenBF16, M>(w, x, x_stride, 0, in_features, acc);
  store_rows<M>(acc, out);
}

template <int M>
void block_int8_avx2(const int8_t* w, const float* scales, const float* x, int64_t x_stride,
                     int64_t in_features, float (&out)[kRows][kBlock]) {
  __m256 acc[M][2];
  dot_avx2<WidenInt8, M>(w, x, x_stride, 0, in_features, acc);
  const __m256 scale_lo = _mm256_loadu_ps(scales), scale_hi = _mm256_loadu_ps(scales + 8);
  for (int m = 0; m < M; ++m) {
    acc[m][0] = _mm256_mul_ps(acc[m][0], scale_lo);
    acc[m][1] = _mm256_mul_ps(acc[m][1], scale_hi);
  }
  store_rows<M>(acc, out);
}

inline __m256 load_halves(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <int M, bool kOffsets>
void block_int4_avx2(const uint8_t* w, const c10::Half* scales, const c10::Half* offsets, const float* x,
                     int64_t x_stride, const float* x_sums, int64_t groups, int64_t in_features,
                     int64_t group, float (&out)[kRows][kBlock]) {
  __m256 total[M][2];
  for (int m = 0; m < M; ++m) total[m][0] = total[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t first = g * group, last = std::min(in_features, first + group);
    __m256 acc[M][2];
    dot_avx2<WidenInt4, M>(w, x, x_stride, first, last, acc);
    const __m256 scale_lo = load_halves(scales + g * kBlock), scale_hi = load_halves(scales + g * kBlock + 8);
    __m256 offset_lo, offset_hi;
    if (kOffsets) {
      offset_lo = load_halves(offsets + g * kBlock);
      offset_hi = load_halves(offsets + g * kBlock + 8);
    } else {
      offset_lo = _mm256_mul_ps(scale_lo, _mm256_set1_ps(-8.f));
      offset_hi = _mm256_mul_ps(scale_hi, _mm256_set1_ps(-8.f));
    }
    for (int m = 0; m < M; ++m) {
      const __m256 x_sum = _mm256_broadcast_ss(x_sums + m * groups + g);
      total[m][0] = _mm256_fmadd_ps(acc[m][0], scale_lo, _mm256_fmadd_ps(offset_lo, x_sum, total[m][0]));
      total[m][1] = _mm256_fmadd_ps(acc[m][1], scale_hi, _mm256_fmadd_ps(offset_hi, x_sum, total[m][1]));
    }
  }
  store_rows<M>(total, out);
}

#endif  // KVIK_WEIGHT_ONLY_AVX2

// Raw pointers into a LinearWeight, taken once per call (data_ptr<T>() checks the dtype each time,
// which in a per-element loop cost more than the arithmetic).
struct WeightView {
  int64_t format, in_features, group, groups;
  const void* data;
  const float* scales_f32;  // int8
  const c10::Half* scales_f16;  // int4
  const c10::Half* offsets;  // int4 with zero points, else null

  explicit WeightView(const kvik::LinearWeight& w)
      : format(w.format), in_features(w.in_features), group(w.group),
        groups(w.format == kvik::kInt4 ? (w.in_features + w.group - 1) / w.group : 0), data(w.data.data_ptr()),
        scales_f32(w.format == kvik::kInt8 ? w.scales.data_ptr<float>() : nullptr),
        scales_f16(w.format == kvik::kInt4 ? w.scales.data_ptr<c10::Half>() : nullptr),
        offsets(w.offsets.defined() ? w.offsets.data_ptr<c10::Half>() : nullptr) {}
};

// The 16 weights of input k of a block, dequantized: row[j] for output block * 16 + j.
inline void dequantize_row(const WeightView& v, int64_t block, int64_t k, float (&row)[kBlock]) {
  if (v.format == kvik::kBFloat16) {
    const auto* w = static_cast<const uint16_t*>(v.data) + (block * v.in_features + k) * kBlock;
    for (int j = 0; j < kBlock; ++j) row[j] = bf16_to_float(w[j]);
  } else if (v.format == kvik::kInt8) {
    const auto* w = static_cast<const int8_t*>(v.data) + (block * v.in_features + k) * kBlock;
    const float* s = v.scales_f32 + block * kBlock;
    for (int j = 0; j < kBlock; ++j) row[j] = static_cast<float>(w[j]) * s[j];
  } else {
    const auto* w = static_cast<const uint8_t*>(v.data) + (block * v.in_features + k) * (kBlock / 2);
    const int64_t at = (block * v.groups + k / v.group) * kBlock;
    for (int j = 0; j < kBlock; ++j) {
      const int nibble = j < kBlock / 2 ? (w[j] & 15) : (w[j - kBlock / 2] >> 4);
      const float scale = static_cast<float>(v.scales_f16[at + j]);
      const float offset = v.offsets ? static_cast<float>(v.offsets[at + j]) : -8.f * scale;
      row[j] = static_cast<float>(nibble) * scale + offset;
    }
  }
}

#if KVIK_WEIGHT_ONLY_AVX2
inline void dequantize_row_avx2(const WeightView& v, int64_t block, int64_t k, float* row) {
  __m256 lo, hi;
  if (v.format == kvik::kBFloat16) {
    WidenBF16::widen(static_cast<const uint16_t*>(v.data) + (block * v.in_features + k) * kBlock, lo, hi);
  } else if (v.format == kvik::kInt8) {
    WidenInt8::widen(static_cast<const int8_t*>(v.data) + (block * v.in_features + k) * kBlock, lo, hi);
    lo = _mm256_mul_ps(lo, _mm256_loadu_ps(v.scales_f32 + block * kBlock));
    hi = _mm256_mul_ps(hi, _mm256_loadu_ps(v.scales_f32 + block * kBlock + 8));
  } else {
    WidenInt4::widen(static_cast<const uint8_t*>(v.data) + (block * v.in_features + k) * (kBlock / 2), lo, hi);
    const int64_t at = (block * v.groups + k / v.group) * kBlock;
    const __m256 scale_lo = load_halves(v.scales_f16 + at), scale_hi = load_halves(v.scales_f16 + at + 8);
    const __m256 offset_lo =
        v.offsets ? load_halves(v.offsets + at) : _mm256_mul_ps(scale_lo, _mm256_set1_ps(-8.f));
    const __m256 offset_hi =
        v.offsets ? load_halves(v.offsets + at + 8) : _mm256_mul_ps(scale_hi, _mm256_set1_ps(-8.f));
    lo = _mm256_fmadd_ps(lo, scale_lo, offset_lo);
    hi = _mm256_fmadd_ps(hi, scale_hi, offset_hi);
  }
  _mm256_storeu_ps(row, lo);
  _mm256_storeu_ps(row + 8, hi);
}
#else
inline void dequantize_row_avx2(const WeightView& v, int64_t block, int64_t k, float* row) {
  dequantize_row(v, block, k, *reinterpret_cast<float(*)[kBlock]>(row));
}
#endif

// Calls f(std::integral_constant<int, M>) for M = rows (1..kRows): the kernels take M as a template.
template <typename F>
void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

// One block for `rows` (1..kRows) rows of x starting at x.
void run_block(const WeightView& v, int64_t block, const float* x, int64_t rows, const float* x_sums,
               float (&out)[kRows][kBlock]) {
  const int64_t in_features = v.in_features, group = v.group, groups = v.groups;
#if KVIK_WEIGHT_ONLY_AVX2
  const bool vector = !portable_only.load(std::memory_order_relaxed);
#else
  constexpr bool vector = false;
#endif
  if (v.format == kvik::kBFloat16) {
    const auto* w = static_cast<const uint16_t*>(v.data) + block * in_features * kBlock;
    with_rows(rows, [&](auto m) {
      constexpr int M = decltype(m)::value;
#if KVIK_WEIGHT_ONLY_AVX2
      if (vector) return block_bf16_avx2<M>(w, x, in_features, in_features, out);
#endif
      block_bf16<M>(w, x, in_features, in_features, out);
    });
  } else if (v.format == kvik::kInt8) {
    const auto* w = static_cast<const int8_t*>(v.data) + block * in_features * kBlock;
    const float* s = v.scales_f32 + block * kBlock;
    with_rows(rows, [&](auto m) {
      constexpr int M = decltype(m)::value;
#if KVIK_WEIGHT_ONLY_AVX2
      if (vector) return block_int8_avx2<M>(w, s, x, in_features, in_features, out);
#endif
      block_int8<M>(w, s, x, in_features, in_features, out);
    });
  } else {
    const auto* w = static_cast<const uint8_t*>(v.data) + block * in_features * (kBlock / 2);
    const c10::Half* s = v.scales_f16 + block * groups * kBlock;
    const c10::Half* o = v.offsets ? v.offsets + block * groups * kBlock : nullptr;
    with_rows(rows, [&](auto m) {
      constexpr int M = decltype(m)::value;
#if KVIK_WEIGHT_ONLY_AVX2
      if (vector && o)
        return block_int4_avx2<M, true>(w, s, o, x, in_features, x_sums, groups, in_features, group, out);
      if (vector)
        return block_int4_avx2<M, false>(w, s, o, x, in_features, x_sums, groups, in_features, group, out);
#endif
      if (o) return block_int4<M, true>(w, s, o, x, in_features, x_sums, groups, in_features, group, out);
      block_int4<M, false>(w, s, o, x, in_features, x_sums, groups, in_features, group, out);
    });
  }
  (void)vector;
}

}  // namespace

namespace kvik {

void check_linear_weight(const LinearWeight& weight) {
  TORCH_CHECK(weight.format == kBFloat16 || weight.format == kInt8 || weight.format == kInt4,
              "not a weight-only format: ", weight.format);
  const int64_t blocks = (weight.out_features + kBlock - 1) / kBlock;
  TORCH_CHECK(weight.data.defined() && weight.data.is_contiguous(), "weight data must be contiguous");
  const int64_t per_input = weight.format == kvik::kInt4 ? kBlock / 2 : kBlock;
  TORCH_CHECK(weight.data.numel() == blocks * weight.in_features * per_input,
              "weight data has ", weight.data.numel(), " elements, expected ",
              blocks * weight.in_features * per_input);
  if (weight.format == kvik::kInt8) {
    TORCH_CHECK(weight.scales.scalar_type() == at::kFloat && weight.scales.numel() == blocks * kBlock,
                "int8 scales: float32, one per padded output row");
  } else if (weight.format == kvik::kInt4) {
    TORCH_CHECK(weight.group > 0, "int4 needs a group size");
    const int64_t groups = (weight.in_features + weight.group - 1) / weight.group;
    TORCH_CHECK(weight.scales.scalar_type() == at::kHalf && weight.scales.numel() == blocks * groups * kBlock,
                "int4 scales: float16 (blocks, groups, 16)");
    TORCH_CHECK(!weight.offsets.defined() || (weight.offsets.scalar_type() == at::kHalf &&
                                               weight.offsets.numel() == weight.scales.numel()),
                "int4 offsets: float16, shaped like the scales");
  }
}

at::Tensor weight_only_linear(const at::Tensor& x, const LinearWeight& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "x must be a contiguous float32 (rows, in_features) tensor");
  TORCH_CHECK(x.size(1) == weight.in_features, "x has ", x.size(1), " features, the weight ",
              weight.in_features);
  check_linear_weight(weight);
  const int64_t rows = x.size(0), in_features = weight.in_features, out_features = weight.out_features;
  const int64_t blocks = (out_features + kBlock - 1) / kBlock;
  const float* bias = nullptr;
  if (weight.bias.has_value() && weight.bias->defined()) {
    TORCH_CHECK(weight.bias->is_contiguous() && weight.bias->numel() == out_features &&
                    weight.bias->scalar_type() == at::kFloat,
                "bias must be float32 with out_features elements");
    bias = weight.bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const WeightView view(weight);
  // int4: each row's sum over each group of inputs, for the groups' offsets.
  const int64_t groups = view.groups;
  std::vector<float> x_sums;
  if (weight.format == kInt4) {
    x_sums.assign(rows * groups, 0.f);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t first = g * weight.group, last = std::min(in_features, first + weight.group);
        float sum = 0.f;
        for (int64_t k = first; k < last; ++k) sum += xp[r * in_features + k];
        x_sums[r * groups + g] = sum;
      }
  }
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    float acc[kRows][kBlock];
    for (int64_t block = begin; block < end; ++block) {
      const int64_t first = block * kBlock, count = std::min<int64_t>(kBlock, out_features - first);
      // Rows in passes of four: the block's weights come from DRAM once, then from cache.
      for (int64_t r = 0; r < rows; r += kRows) {
        const int64_t chunk = std::min<int64_t>(kRows, rows - r);
        run_block(view, block, xp + r * in_features, chunk, x_sums.data() + r * groups, acc);
        for (int64_t m = 0; m < chunk; ++m) {
          float* o = op + (r + m) * out_features + first;
          for (int64_t j = 0; j < count; ++j) o[j] = acc[m][j] + (bias ? bias[first + j] : 0.f);
        }
      }
    }
  });
  return out;
}

at::Tensor dequantize_transposed(const LinearWeight& weight, bool bfloat16) {
  check_linear_weight(weight);
  const int64_t in_features = weight.in_features, out_features = weight.out_features;
  const int64_t blocks = (out_features + kBlock - 1) / kBlock;
  at::Tensor out = at::empty({in_features, out_features},
                             weight.data.options().dtype(bfloat16 ? at::kBFloat16 : at::kFloat));
#if KVIK_WEIGHT_ONLY_AVX2
  const bool vector = !portable_only.load(std::memory_order_relaxed);
#else
  constexpr bool vector = false;
#endif
  const WeightView view(weight);
  float* out_f32 = bfloat16 ? nullptr : out.data_ptr<float>();
  c10::BFloat16* out_bf16 = bfloat16 ? out.data_ptr<c10::BFloat16>() : nullptr;
  // Tiles of kTileBlocks blocks: for each input k the tile writes one contiguous run of 8 * 16 outputs
  // (a block at a time wrote 64 bytes per row, 4-8 KiB apart, at a sixth of a plain fill's speed).
  constexpr int64_t kTileBlocks = 8;
  const int64_t tiles = (blocks + kTileBlocks - 1) / kTileBlocks;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    float row[kBlock];
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t tile_end = std::min(blocks, (tile + 1) * kTileBlocks);
      for (int64_t k = 0; k < in_features; ++k) {
        for (int64_t block = tile * kTileBlocks; block < tile_end; ++block) {
          const int64_t first = block * kBlock, count = std::min<int64_t>(kBlock, out_features - first);
          if (vector && out_f32 && count == kBlock) {  // the common case: straight to the output
            dequantize_row_avx2(view, block, k, out_f32 + k * out_features + first);
            continue;
          }
          if (vector) {
            dequantize_row_avx2(view, block, k, row);
          } else {
            dequantize_row(view, block, k, row);
          }
          if (out_bf16) {
            c10::BFloat16* dst = out_bf16 + k * out_features + first;
            for (int64_t j = 0; j < count; ++j) dst[j] = c10::BFloat16(row[j]);
          } else {
            std::memcpy(out_f32 + k * out_features + first, row, count * sizeof(float));
          }
        }
      }
    }
  });
  return out;
}

at::Tensor LinearWeight::operator()(const at::Tensor& x) const {
  if (format == kPackedFloat32) return gemv_packed(x, address, out_features, in_stride, block, bias);
  return weight_only_linear(x, *this);
}

void set_portable_kernels(bool portable) { portable_only.store(portable); }

const char* simd_isa() {
  if (portable_only.load()) return "portable";
#if KVIK_WEIGHT_ONLY_AVX2 && defined(__AVX512F__)
  return "avx2 (on an AVX-512 CPU)";
#elif KVIK_WEIGHT_ONLY_AVX2
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace kvik
