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
// stream. int4 takes inputs eight at a time instead: a chunk of 64 bytes holds the 16 rows' weights
// of inputs 8c..8c+7, row j in bytes 4j..4j+3, input 8c+i in the low nibble of byte 4j+i and input
// 8c+4+i in its high nibble (the last chunk padded with zeros). Masking the low or high nibbles of a
// chunk then gives, in each 32-bit lane, one row's four consecutive inputs: vpdpbusd's operand as it
// is, where the earlier layout (rows j and j + 8 in byte j, per input) needed two byte permutes per
// 64 bytes, 30 % of the one-row kernel's speed from cache. int4 scales (and offsets) are per group
// of `group` input elements and per row, float16. int8 has a float32 scale per row (group 0) or,
// like int4, a float16 one per row and group.
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
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "decode_team.h"
#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVIK_WEIGHT_ONLY_AVX2 1
#else
#define KVIK_WEIGHT_ONLY_AVX2 0
#endif
// int8 activations on int8 / int4 weights: vpdpbusd (AVX512-VNNI) and byte permutes (AVX512-VBMI).
#if KVIK_WEIGHT_ONLY_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VBMI__)
#define KVIK_INT8_DOT 1
#else
#define KVIK_INT8_DOT 0
#endif

namespace {

std::atomic<bool> portable_only{false};
std::atomic<bool> int8_activations{true};
std::atomic<int64_t> prefetch_distance{kvik::kWeightPrefetchBytes};

// The prefetch distance for one kernel call, read once: the loops below add it to each address.
inline int64_t prefetch_ahead() { return prefetch_distance.load(std::memory_order_relaxed); }

constexpr int kBlock = static_cast<int>(kvik::kWeightBlock);
constexpr int kRows = 4;  // rows of x per pass over a block of weights (accumulators in registers)

// int4's chunks of 8 inputs (64 bytes, see the top): where input k's chunk starts in its block, the
// shift of its nibble within row j's byte 4j + (k & 3), and a block's bytes.
inline int64_t int4_chunk_offset(int64_t k) { return (k >> 3) * 64; }
inline int int4_nibble_shift(int64_t k) { return (k & 4) ? 4 : 0; }
inline int64_t int4_block_bytes(int64_t in_features) { return (in_features + 7) / 8 * 64; }

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

// acc[m][j] = sum over inputs k in [first, last) of W[j][k] x[m][k], int8 weights unscaled.
template <int M>
void int8_dot_range(const int8_t* w, const float* x, int64_t x_stride, int64_t first, int64_t last,
                    float (&acc)[M][kBlock]) {
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < kBlock; ++j) acc[m][j] = 0.f;
  for (int64_t k = first; k < last; ++k) {
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
}

template <int M>
void block_int8(const int8_t* w, const float* scales, const float* x, int64_t x_stride, int64_t in_features,
                float (&out)[kRows][kBlock]) {
  float acc[M][kBlock];
  int8_dot_range<M>(w, x, x_stride, 0, in_features, acc);
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < kBlock; ++j) out[m][j] = acc[m][j] * scales[j];
}

// int8 with a scale per group of inputs: each group's products summed unscaled, then scaled.
template <int M>
void block_int8_grouped(const int8_t* w, const c10::Half* scales, const float* x, int64_t x_stride, int64_t groups,
                        int64_t in_features, int64_t group, float (&out)[kRows][kBlock]) {
  float total[M][kBlock] = {};
  for (int64_t g = 0; g < groups; ++g) {
    float acc[M][kBlock];
    int8_dot_range<M>(w, x, x_stride, g * group, std::min(in_features, (g + 1) * group), acc);
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < kBlock; ++j) total[m][j] += acc[m][j] * static_cast<float>(scales[g * kBlock + j]);
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < kBlock; ++j) out[m][j] = total[m][j];
}

// Per group the nibbles' products are summed unscaled; the group's scale and offset are applied
// once at its end: sum_k (u s + o) x_k = s sum_k u x_k + o sum_k x_k, with sum_k x_k precomputed
// per row and group (x_sums). Symmetric weights have o = -8 s.
template <int M, bool kOffsets>
void block_int4(const uint8_t* w, const c10::Half* scales, const c10::Half* offsets, const float* x,
                int64_t x_stride, const float* x_sums, int64_t groups, int64_t in_features, int64_t group,
                float (&out)[kRows][kBlock]) {
  float total[M][kBlock] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t first = g * group, last = std::min(in_features, first + group);
    float acc[M][kBlock] = {};
    for (int64_t k = first; k < last; ++k) {
      const uint8_t* wk = w + int4_chunk_offset(k) + (k & 3);
      const int shift = int4_nibble_shift(k);
      float wf[kBlock];
#pragma omp simd
      for (int j = 0; j < kBlock; ++j) wf[j] = static_cast<float>((wk[4 * j] >> shift) & 15);
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
  static inline void widen(const uint16_t* block, int64_t k, __m256& lo, __m256& hi) {
    const uint16_t* w = block + k * kBlock;
    const __m256i low = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    const __m256i high = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 8)));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(low, 16));
    hi = _mm256_castsi256_ps(_mm256_slli_epi32(high, 16));
  }
};

struct WidenInt8 {
  using Stored = int8_t;
  static constexpr int kPerInput = 16;
  static inline void widen(const int8_t* block, int64_t k, __m256& lo, __m256& hi) {
    const int8_t* w = block + k * kBlock;
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 8))));
  }
};

struct WidenInt4 {  // chunks of 8 inputs: 32-bit lane j holds row j's nibbles, input k's at one shift
  using Stored = uint8_t;
  static constexpr int kPerInput = 8;  // bytes per input, on average: for the prefetch
  static inline void widen(const uint8_t* block, int64_t k, __m256& lo, __m256& hi) {
    const uint8_t* chunk = block + int4_chunk_offset(k);
    const __m128i shift = _mm_cvtsi32_si128(8 * static_cast<int>(k & 3) + int4_nibble_shift(k));
    const __m256i nibble = _mm256_set1_epi32(15);
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(
        _mm256_srl_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk)), shift), nibble));
    hi = _mm256_cvtepi32_ps(_mm256_and_si256(
        _mm256_srl_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32)), shift), nibble));
  }
};

// Independent accumulator chains per row count: an FMA's result is ready after 4 cycles and two
// can start per cycle, so one row needs about eight chains in flight (16 outputs = 2 per input).
template <int M>
constexpr int kUnroll = M == 1 ? 4 : (M == 2 ? 2 : 1);

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
  const int64_t ahead = prefetch_ahead();
  for (int64_t k = first; k < first + count; k += U) {
    // The weights are one sequential stream, but the hardware prefetcher stops at every 4 KiB page
    // and runs behind a loop that consumes so few bytes per cycle: asking for them `ahead` bytes
    // ahead keeps the stream at the memory's speed.
    for (int line = 0; line < kLines; ++line)
      __builtin_prefetch(reinterpret_cast<const char*>(w + k * Widen::kPerInput) + ahead + 64 * line,
                         0, 1);
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      __m256 lo, hi;
      Widen::widen(w, k + u, lo, hi);
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

#if defined(__AVX512F__)
// The 16 bfloat16 weights at w (one input of a block) as float32: one 32-byte load into one register.
inline __m512 widen_bf16_avx512(const uint16_t* w) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w))), 16));
}

// bfloat16 on AVX-512: a block's 16 weights of one input are one 32-byte load widened into one
// register (the AVX2 code needs two of each), with U independent FMA chains per row.
template <int M>
void block_bf16_avx512(const uint16_t* w, const float* x, int64_t x_stride, int64_t in_features,
                       float (&out)[kRows][kBlock]) {
  constexpr int U = M == 1 ? 8 : (M == 2 ? 4 : 2);
  __m512 part[U * M];
  for (int i = 0; i < U * M; ++i) part[i] = _mm512_setzero_ps();
  const int64_t body = in_features / U * U, ahead = prefetch_ahead();
  // The 16 weights of input k, widened to float32.
  const auto widen = [w](int64_t k) { return widen_bf16_avx512(w + k * kBlock); };
  for (int64_t k = 0; k < body; k += U) {
    for (int line = 0; line < U * kBlock * 2 / 64; ++line)
      __builtin_prefetch(reinterpret_cast<const char*>(w + k * kBlock) + ahead + 64 * line, 0, 1);
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      const __m512 wv = widen(k + u);
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m)
        part[u * M + m] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[m * x_stride + k + u]), part[u * M + m]);
    }
  }
  for (int64_t k = body; k < in_features; ++k) {
    const __m512 wv = widen(k);
    for (int m = 0; m < M; ++m) part[m] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[m * x_stride + k]), part[m]);
  }
  for (int m = 0; m < M; ++m) {
    __m512 sum = part[m];
    for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, part[u * M + m]);
    _mm512_storeu_ps(out[m], sum);
  }
}

// Many rows (prompts) on float32 activations: tiles of M <= kTileRows rows by two blocks (32 outputs),
// one accumulator register per row and block, so each weight register feeds M FMAs and each
// broadcast input two (the four-row passes above feed four per load; widening the whole matrix to
// float32 for a GEMM wrote and re-read 4 bytes per weight per call, 0.7 ms per 768x2048 layer, as
// much as a 64-row product itself). A pair of blocks is widened to float32 (int8 / int4 with their
// scales and offsets) once per chunk of rows, into a buffer that stays in L2: widening bfloat16 in
// the tile's loop (4 ops per 24 FMAs) ran it at 2/3 of the speed. 2 x 12 accumulators + 2 weights
// leave registers for the compiler.
constexpr int kTileRows = 12;
// Bytes of inputs per chunk of rows: a chunk stays in L2 (with the widened pair, re-read once per
// tile of the chunk) while every pair of blocks is widened once for it.
constexpr int64_t kChunkBytes = 1 << 20;

// The B blocks at w, w + block_stride as float32, input-major: block b's 16 weights of input k at
// wide[(k * B + b) * 16].
template <int B>
void widen_blocks(const uint16_t* w, int64_t block_stride, int64_t in_features, float* wide) {
  const int64_t ahead = prefetch_ahead();
  for (int64_t k = 0; k < in_features; ++k)
    for (int b = 0; b < B; ++b) {
      // The first chunk reads the weights from memory: ask for them ahead, as the one-row kernels do.
      if (k % 2 == 0)
        __builtin_prefetch(reinterpret_cast<const char*>(w + b * block_stride + k * kBlock) + ahead, 0, 1);
      _mm512_storeu_ps(wide + (k * B + b) * kBlock, widen_bf16_avx512(w + b * block_stride + k * kBlock));
    }
}

// out[m * out_stride + b * 16 + j] = sum_k W_b[j][k] x[m][k] (+ bias) for B widened blocks, the last
// one's `count` outputs; x row-major (a copy of each tile input-major, one cache line per input's
// broadcasts, measured no faster).
template <int M, int B>
void tile_f32_avx512(const float* wide, const float* x, int64_t in_features, const float* bias, int64_t count,
                     float* out, int64_t out_stride) {
  const int64_t x_stride = in_features;
  // Under eight chains the FMA units wait on each other's results: two inputs at a time.
  constexpr int U = M * B >= 8 ? 1 : 2;
  __m512 part[U * M * B];
  for (int i = 0; i < U * M * B; ++i) part[i] = _mm512_setzero_ps();
  const int64_t body = in_features / U * U;
  for (int64_t k = 0; k < body; k += U) {
#pragma GCC unroll 2
    for (int u = 0; u < U; ++u) {
      __m512 wv[B];
#pragma GCC unroll 2
      for (int b = 0; b < B; ++b) wv[b] = _mm512_loadu_ps(wide + ((k + u) * B + b) * kBlock);
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        const __m512 xv = _mm512_set1_ps(x[m * x_stride + k + u]);
#pragma GCC unroll 2
        for (int b = 0; b < B; ++b)
          part[(u * M + m) * B + b] = _mm512_fmadd_ps(wv[b], xv, part[(u * M + m) * B + b]);
      }
    }
  }
  for (int64_t k = body; k < in_features; ++k) {
    for (int b = 0; b < B; ++b) {
      const __m512 wv = _mm512_loadu_ps(wide + (k * B + b) * kBlock);
      for (int m = 0; m < M; ++m)
        part[m * B + b] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[m * x_stride + k]), part[m * B + b]);
    }
  }
  for (int b = 0; b < B; ++b) {
    const __mmask16 mask = b + 1 < B ? __mmask16(0xffff) : static_cast<__mmask16>((1u << count) - 1);
    const __m512 add = bias ? _mm512_maskz_loadu_ps(mask, bias + b * kBlock) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) {
      __m512 sum = part[m * B + b];
      if (U == 2) sum = _mm512_add_ps(sum, part[(M + m) * B + b]);
      _mm512_mask_storeu_ps(out + m * out_stride + b * kBlock, mask, _mm512_add_ps(sum, add));
    }
  }
}

using TileKernel = void (*)(const float*, const float*, int64_t, const float*, int64_t, float*, int64_t);

template <int B, std::size_t... I>
constexpr std::array<TileKernel, sizeof...(I)> tile_kernels(std::index_sequence<I...>) {
  return {&tile_f32_avx512<static_cast<int>(I) + 1, B>...};
}

#endif

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

template <int M>
void block_int8_grouped_avx2(const int8_t* w, const c10::Half* scales, const float* x, int64_t x_stride,
                             int64_t groups, int64_t in_features, int64_t group, float (&out)[kRows][kBlock]) {
  __m256 total[M][2];
  for (int m = 0; m < M; ++m) total[m][0] = total[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 acc[M][2];
    dot_avx2<WidenInt8, M>(w, x, x_stride, g * group, std::min(in_features, (g + 1) * group), acc);
    const __m256 scale_lo = load_halves(scales + g * kBlock), scale_hi = load_halves(scales + g * kBlock + 8);
    for (int m = 0; m < M; ++m) {
      total[m][0] = _mm256_fmadd_ps(acc[m][0], scale_lo, total[m][0]);
      total[m][1] = _mm256_fmadd_ps(acc[m][1], scale_hi, total[m][1]);
    }
  }
  store_rows<M>(total, out);
}

#endif  // KVIK_WEIGHT_ONLY_AVX2

#if KVIK_INT8_DOT

// ---- int8 activations (AVX512-VNNI) ----
//
// A decoding step on int4 weights that are widened to float is bound by the widening, not by the
// bytes (one FMA per 8 weights per row, after two conversions), and a prompt's GEMM widens the
// whole weight first. With the activations rounded to int8 (per row and block of 32 inputs, scale
// = max |x| / 127, as llama.cpp's q8 activations), vpdpbusd multiplies 64 weight bytes by 64
// activation bytes in one instruction and sums in exact int32; the float work is one conversion
// and FMA per block of 32 inputs. The result is exactly x' W (float rounding aside), where x' is x
// after that rounding: W's own rounding is unchanged, and each row's numbers depend only on that
// row, not on what shares the batch.
//
// vpdpbusd wants 4 consecutive inputs of one output row in each 32-bit lane. int4's chunks hold
// them so (masking a chunk's low or high nibbles gives the two operands). int8 stores, per input k,
// the 16 rows of a block side by side; one byte permute (vpermb, AVX512-VBMI) per 64 bytes turns
// that into lanes in registers (with it a one-row int8 call runs from cache at 44-47 GB/s per core,
// as fast as one core reads memory here, so int8 keeps the layout it shares with the float kernels).

constexpr int64_t kActBlock = 32;

struct LaneIndex {
  alignas(64) uint8_t int8[64];
  constexpr LaneIndex() : int8() {
    for (int lane = 0; lane < 16; ++lane)
      for (int i = 0; i < 4; ++i) int8[lane * 4 + i] = static_cast<uint8_t>(i * 16 + lane);  // 4 inputs x 16 rows
  }
};
constexpr LaneIndex kLaneIndex{};

inline __m512i broadcast4(const uint8_t* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  return _mm512_set1_epi32(word);
}

// Rows of x rounded to int8 per block of 32 inputs, the codes signed: vpdpbusd's second operand.
// Its first, unsigned, is the weights: int4's nibbles as they are, int8's codes plus 128 (flipping
// the sign bit after the load), so an int8 block's sum comes out 128 x (the block's code sum) too
// high, and the kernel subtracts that, one number per row and block (`correction`). The earlier
// way round (activation codes plus 128, weights signed) had to subtract 128 x each row's weight
// sum instead, one more vpdpbusd per 64 weight bytes; and with the weights as the last operand
// (the only one that may come from memory) GCC folded their load into each of a pass's four
// multiplies, four 64-byte loads where one serves now: int8 prompts ran at 0.79x today's speed.
struct QuantizedRows {
  std::vector<uint8_t> codes;      // rows x in_features
  std::vector<float> scales;       // rows x blocks of 32
  std::vector<int32_t> correction; // rows x blocks of 32: 128 x the block's sum of codes
  std::vector<float> group_sums;   // int4: rows x groups, sum of the rounded x over each weight group
};

void quantize_rows(const float* x, int64_t rows, int64_t in_features, int64_t group, QuantizedRows& out) {
  const int64_t blocks = in_features / kActBlock, groups = group ? (in_features + group - 1) / group : 0;
  out.codes.resize(rows * in_features);
  out.scales.resize(rows * blocks);
  out.correction.resize(rows * blocks);
  out.group_sums.assign(rows * groups, 0.f);
  const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        const float* xb = x + r * in_features + b * kActBlock;
        const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_and_ps(v0, sign_off), _mm512_and_ps(v1, sign_off)));
        const float inverse = amax > 0.f ? 127.f / amax : 0.f;
        // cvtps rounds to nearest even (the default MXCSR mode); |x * inverse| <= 127.
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inverse)));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inverse)));
        const float scale = amax / 127.f;
        const int32_t code_sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        out.scales[r * blocks + b] = scale;
        out.correction[r * blocks + b] = code_sum * 128;
        if (groups) out.group_sums[r * groups + b * kActBlock / group] += scale * static_cast<float>(code_sum);
        const __m128i c0 = _mm512_cvtepi32_epi8(q0), c1 = _mm512_cvtepi32_epi8(q1);
        uint8_t* dst = out.codes.data() + r * in_features + b * kActBlock;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), c0);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), c1);
      }
    }
  });
}

// One block's chunk of inputs k..k+7 (64 bytes) as the two vpdpbusd operands: lane L of wa holds
// row L's codes of inputs k..k+3 (the low nibbles), of wb those of k+4..k+7 (the high ones), left
// in place: 16 x their value, still within the unsigned byte, so one mask each and no shift per 64
// bytes; the kernel divides their sums by 16 (exactly, a shift) once per block.
inline void unpack_int4_8(const uint8_t* wk, __m512i& wa, __m512i& wb) {
  const __m512i raw = _mm512_loadu_si512(wk);
  wa = _mm512_and_si512(raw, _mm512_set1_epi8(0x0f));
  wb = _mm512_and_si512(raw, _mm512_set1_epi8(static_cast<char>(0xf0)));
}

// A prompt's rows pass over each block of weights many times: the nibbles are split once per call
// into this buffer, one vector per 4 inputs as int8's (128 bytes per 8 inputs, a block of 2048
// inputs is 32 KiB, so it stays in L1/L2), the high nibbles shifted down, so every pass reads the
// operands as they are and sums both halves in one accumulator (tile_vnni). The integer sum is the
// one block_int4_vnni makes from its two (high nibbles in place, then divided by 16), so a row's
// result does not depend on which kernel ran it.
void unpack_int4_block(const uint8_t* w, int64_t in_features, __m512i* out) {
  for (int64_t k = 0; k < in_features; k += 8) {
    unpack_int4_8(w + int4_chunk_offset(k), out[k / 4], out[k / 4 + 1]);
    out[k / 4 + 1] = _mm512_srli_epi16(out[k / 4 + 1], 4);  // bytes 0xf0-masked: no bits cross
  }
}

// out[m][j] = sum_k W[j][k] x'[m][k] for one block of 16 rows, int4 weights: per group,
// s_j sum_b d_b (sum_{k in b} v_jk q_k) + o_j sum_{k in group} x'_k (decode steps; prompts run
// tile_vnni, which sums in the same order).
template <int M, bool kOffsets>
void block_int4_vnni(const uint8_t* w, const c10::Half* scales, const c10::Half* offsets, const uint8_t* codes,
                     int64_t in_features, const float* act_scales, const float* group_sums, int64_t groups,
                     int64_t group, float (*out)[kBlock]) {
  const int64_t blocks = in_features / kActBlock, per_group = group / kActBlock, ahead = prefetch_ahead();
  __m512 total[M];
  for (int m = 0; m < M; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * kBlock)));
    for (int64_t b = g * per_group; b < std::min(blocks, (g + 1) * per_group); ++b) {
      // One row: two chains per operand (even and odd steps), so a vpdpbusd does not wait on
      // the one before it (latency 5) in the short 4-step block.
      constexpr int C = M == 1 ? 2 : 1;
      __m512i acc_a[C * M], acc_b[C * M];
      for (int m = 0; m < C * M; ++m) acc_a[m] = acc_b[m] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int step = 0; step < 4; ++step) {
        const int64_t k = b * kActBlock + step * 8;
        __m512i wa, wb;
        const uint8_t* wk = w + int4_chunk_offset(k);
        __builtin_prefetch(wk + ahead, 0, 1);
        unpack_int4_8(wk, wa, wb);
        const int c = (step % C) * M;
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) {
          acc_a[c + m] = _mm512_dpbusd_epi32(acc_a[c + m], wa, broadcast4(codes + m * in_features + k));
          acc_b[c + m] = _mm512_dpbusd_epi32(acc_b[c + m], wb, broadcast4(codes + m * in_features + k + 4));
        }
      }
      if (C == 2)
        for (int m = 0; m < M; ++m) {
          acc_a[m] = _mm512_add_epi32(acc_a[m], acc_a[M + m]);
          acc_b[m] = _mm512_add_epi32(acc_b[m], acc_b[M + m]);
        }
      for (int m = 0; m < M; ++m) acc_b[m] = _mm512_srai_epi32(acc_b[m], 4);  // the high nibbles' 16x
      // The group's scale times the block's: one product per block and row. A separate sum per
      // group, scaled once at its end, took 8 more registers in tile_vnni, whose passes then ran at
      // 0.85x (the two kernels must sum in one order, see there).
      for (int m = 0; m < M; ++m)
        total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(acc_a[m], acc_b[m])),
                                   _mm512_mul_ps(scale, _mm512_set1_ps(act_scales[m * blocks + b])), total[m]);
    }
    const __m512 offset = kOffsets
        ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(offsets + g * kBlock)))
        : _mm512_mul_ps(scale, _mm512_set1_ps(-8.f));
    for (int m = 0; m < M; ++m)
      total[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(group_sums[m * groups + g]), total[m]);
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out[m], total[m]);
}

// The same for int8 weights: per block of 32 inputs, the weights' codes plus 128 (the sign bit
// flipped after the permute) times the signed activation codes, less 128 x the codes' sum
// (QuantizedRows::correction). Scales per row (kGrouped false: `row_scales`, applied once at the
// end) or per group of `group` inputs (float16 `group_scales`, folded into each block's activation
// scale: one multiply per block and row, where a separate sum per group cost a prompt 10-20 %).
// A prompt's tiles (tile_vnni) read an int8 block from unpack_int8_block's buffer instead: the
// permuted, flipped operands, 8 vectors per block of 32 inputs, made once per call.
inline __m512i int8_operand(const int8_t* wk, __m512i index) {
  return _mm512_xor_si512(_mm512_permutexvar_epi8(index, _mm512_loadu_si512(wk)),
                          _mm512_set1_epi8(static_cast<char>(0x80)));
}

void unpack_int8_block(const int8_t* w, int64_t in_features, __m512i* out) {
  const __m512i index = _mm512_load_si512(kLaneIndex.int8);
  for (int64_t k = 0; k < in_features; k += 4) out[k / 4] = int8_operand(w + k * kBlock, index);
}

template <int M, bool kGrouped>
void block_int8_vnni(const int8_t* w, const float* row_scales, const c10::Half* group_scales, const uint8_t* codes,
                     int64_t in_features, const float* act_scales, const int32_t* correction, int64_t group,
                     float (*out)[kBlock]) {
  const __m512i index = _mm512_load_si512(kLaneIndex.int8);
  const int64_t blocks = in_features / kActBlock, per_group = kGrouped ? group / kActBlock : 1;
  const int64_t ahead = prefetch_ahead();
  __m512 total[M];
  for (int m = 0; m < M; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    // One row: two chains (even and odd steps), so a vpdpbusd does not wait on the one before it
    // (latency 5). (From memory, decode runs at the read's pace with one chain or two.)
    constexpr int C = M == 1 ? 2 : 1;
    __m512i acc[C * M];
    for (int m = 0; m < C * M; ++m) acc[m] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int step = 0; step < 8; ++step) {
      const int64_t k = b * kActBlock + step * 4;
      const int c = (step % C) * M;
      const int8_t* wk = w + k * kBlock;
      __builtin_prefetch(wk + ahead, 0, 1);
      const __m512i wv = int8_operand(wk, index);
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m)
        acc[c + m] = _mm512_dpbusd_epi32(acc[c + m], wv, broadcast4(codes + m * in_features + k));
    }
    if (C == 2)
      for (int m = 0; m < M; ++m) acc[m] = _mm512_add_epi32(acc[m], acc[M + m]);
    __m512 weight_scale = _mm512_set1_ps(1.f);
    if (kGrouped)
      weight_scale = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group_scales + b / per_group * kBlock)));
    for (int m = 0; m < M; ++m) {
      const __m512 scale = kGrouped ? _mm512_mul_ps(weight_scale, _mm512_set1_ps(act_scales[m * blocks + b]))
                                    : _mm512_set1_ps(act_scales[m * blocks + b]);
      const __m512i exact = _mm512_sub_epi32(acc[m], _mm512_set1_epi32(correction[m * blocks + b]));
      total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), scale, total[m]);
    }
  }
  const __m512 scale = kGrouped ? _mm512_set1_ps(1.f) : _mm512_loadu_ps(row_scales);
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out[m], _mm512_mul_ps(total[m], scale));
}

// Prompts: M rows (1..4) by NB blocks (1..2, 16 outputs each) from unpacked operands, one unsigned
// vector per 4 inputs of a block (unpack_int4_block, unpack_int8_block). Until 2026-12-07 prompts
// ran the four-row passes over one block (block_int*_vnni on the unpacked operands): int8's four
// accumulators were four dependent vpdpbusd chains (latency 4-5, two issued per cycle), half the
// instruction's rate on this Zen 5. Two blocks make eight chains, and each broadcast input feeds
// two products; 16 linears of the reference model's four shapes at 512 rows ran 1.1-1.2x faster
// in int8 and 1.18-1.2x in int4 (alternating processes). The sums and their scaling run in block_int4_vnni's
// and block_int8_vnni's order (int8's correction is the accumulator's start instead of a
// subtraction, the same int32), so a row's result has the same bits whichever kernel ran it.
constexpr int kTileBlocks = 2;

struct TileBlock {
  const __m512i* operands;
  const c10::Half* scales;   // per group (int4, grouped int8), this block's
  const c10::Half* offsets;  // int4 with zero points
  const float* row_scales;   // int8 with a scale per row
};

struct TileRows {
  const uint8_t* codes;
  const float* act_scales;
  const int32_t* correction;
  const float* group_sums;
  int64_t in_features, groups, group;
};

template <int M, int NB, bool kInt4, bool kGrouped, bool kOffsets>
void tile_vnni(const TileBlock (&blk)[NB], const TileRows& x, float (*out)[kTileBlocks * kBlock]) {
  const int64_t in_features = x.in_features, blocks = in_features / kActBlock;
  const int64_t per_group = kGrouped ? x.group / kActBlock : blocks;
  __m512 total[M][NB], weight_scale[NB];
  for (int nb = 0; nb < NB; ++nb) weight_scale[nb] = _mm512_set1_ps(1.f);
  for (int m = 0; m < M; ++m)
    for (int nb = 0; nb < NB; ++nb) total[m][nb] = _mm512_setzero_ps();
  const __m512i* operands[NB];
  for (int nb = 0; nb < NB; ++nb) operands[nb] = blk[nb].operands;
  const uint8_t* codes = x.codes;
  // Groups, then their blocks of 32 inputs: no division in the loop (per_group is a run-time value).
  for (int64_t g = 0, b = 0; b < blocks; ++g) {
    if (kGrouped)
      for (int nb = 0; nb < NB; ++nb)
        weight_scale[nb] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[nb].scales + g * kBlock)));
    for (const int64_t group_end = std::min(blocks, b + per_group); b < group_end; ++b) {
      __m512i acc[M][NB];
      for (int m = 0; m < M; ++m) {
        const __m512i start = kInt4 ? _mm512_setzero_si512() : _mm512_set1_epi32(-x.correction[m * blocks + b]);
        for (int nb = 0; nb < NB; ++nb) acc[m][nb] = start;
      }
#pragma GCC unroll 8
      for (int step = 0; step < 8; ++step) {
        __m512i w[NB];
        for (int nb = 0; nb < NB; ++nb) w[nb] = _mm512_load_si512(operands[nb] + step);
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) {
          const __m512i a = broadcast4(codes + m * in_features + step * 4);
          for (int nb = 0; nb < NB; ++nb) acc[m][nb] = _mm512_dpbusd_epi32(acc[m][nb], w[nb], a);
        }
      }
      for (int nb = 0; nb < NB; ++nb) operands[nb] += kActBlock / 4;
      codes += kActBlock;
      for (int m = 0; m < M; ++m) {
        const __m512 act = _mm512_set1_ps(x.act_scales[m * blocks + b]);
        for (int nb = 0; nb < NB; ++nb)
          total[m][nb] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][nb]),
                                         kGrouped ? _mm512_mul_ps(weight_scale[nb], act) : act, total[m][nb]);
      }
    }
    if (kInt4)  // the group's offsets times the sum of its inputs
      for (int nb = 0; nb < NB; ++nb) {
        const __m512 offset = kOffsets
            ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[nb].offsets + g * kBlock)))
            : _mm512_mul_ps(weight_scale[nb], _mm512_set1_ps(-8.f));
        for (int m = 0; m < M; ++m)
          total[m][nb] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x.group_sums[m * x.groups + g]), total[m][nb]);
      }
  }
  for (int m = 0; m < M; ++m)
    for (int nb = 0; nb < NB; ++nb)
      _mm512_storeu_ps(out[m] + nb * kBlock,
                       kGrouped ? total[m][nb] : _mm512_mul_ps(total[m][nb], _mm512_loadu_ps(blk[nb].row_scales)));
}

#endif  // KVIK_INT8_DOT

// Raw pointers into a LinearWeight, taken once per call (data_ptr<T>() checks the dtype each time,
// which in a per-element loop cost more than the arithmetic).
struct WeightView {
  int64_t format, in_features, group, groups;
  bool allow_int8_activations, allow_bf16_activations;
  const void* data;
  const float* scales_f32;  // int8 per row
  const c10::Half* scales_f16;  // int4, int8 per group
  const c10::Half* offsets;  // int4 with zero points, else null

  explicit WeightView(const kvik::LinearWeight& w)
      : format(w.format), in_features(w.in_features), group(w.group),
        groups(grouped(w) ? (w.in_features + w.group - 1) / w.group : 0),
        allow_int8_activations(w.allow_int8_activations), allow_bf16_activations(w.allow_bf16_activations),
        data(w.data.data_ptr()),
        scales_f32(w.format == kvik::kInt8 && !grouped(w) ? w.scales.data_ptr<float>() : nullptr),
        scales_f16(grouped(w) ? w.scales.data_ptr<c10::Half>() : nullptr),
        offsets(w.offsets.defined() ? w.offsets.data_ptr<c10::Half>() : nullptr) {}

  // Scales per group of inputs: int4 always, int8 when it has a group size.
  static bool grouped(const kvik::LinearWeight& w) {
    return w.format == kvik::kInt4 || (w.format == kvik::kInt8 && w.group > 0);
  }
};

// The 16 weights of input k of a block, dequantized: row[j] for output block * 16 + j.
inline void dequantize_row(const WeightView& v, int64_t block, int64_t k, float (&row)[kBlock]) {
  if (v.format == kvik::kBFloat16) {
    const auto* w = static_cast<const uint16_t*>(v.data) + (block * v.in_features + k) * kBlock;
    for (int j = 0; j < kBlock; ++j) row[j] = bf16_to_float(w[j]);
  } else if (v.format == kvik::kInt8) {
    const auto* w = static_cast<const int8_t*>(v.data) + (block * v.in_features + k) * kBlock;
    for (int j = 0; j < kBlock; ++j)
      row[j] = static_cast<float>(w[j]) *
               (v.scales_f32 ? v.scales_f32[block * kBlock + j]
                             : static_cast<float>(v.scales_f16[(block * v.groups + k / v.group) * kBlock + j]));
  } else {
    const auto* w = static_cast<const uint8_t*>(v.data) + block * int4_block_bytes(v.in_features) +
                    int4_chunk_offset(k) + (k & 3);
    const int shift = int4_nibble_shift(k);
    const int64_t at = (block * v.groups + k / v.group) * kBlock;
    for (int j = 0; j < kBlock; ++j) {
      const int nibble = (w[4 * j] >> shift) & 15;
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
    WidenBF16::widen(static_cast<const uint16_t*>(v.data) + block * v.in_features * kBlock, k, lo, hi);
  } else if (v.format == kvik::kInt8) {
    WidenInt8::widen(static_cast<const int8_t*>(v.data) + block * v.in_features * kBlock, k, lo, hi);
    if (v.scales_f32) {
      lo = _mm256_mul_ps(lo, _mm256_loadu_ps(v.scales_f32 + block * kBlock));
      hi = _mm256_mul_ps(hi, _mm256_loadu_ps(v.scales_f32 + block * kBlock + 8));
    } else {
      const int64_t at = (block * v.groups + k / v.group) * kBlock;
      lo = _mm256_mul_ps(lo, load_halves(v.scales_f16 + at));
      hi = _mm256_mul_ps(hi, load_halves(v.scales_f16 + at + 8));
    }
  } else {
    WidenInt4::widen(static_cast<const uint8_t*>(v.data) + block * int4_block_bytes(v.in_features), k, lo, hi);
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

#if KVIK_WEIGHT_ONLY_AVX2 && defined(__AVX512F__)
// y = x W^T + b for `rows` rows of x, in tiles of up to kTileRows rows on float32 copies of each pair
// of blocks (bfloat16 widened on AVX-512 registers; int8 / int4 dequantized with their scales and
// offsets, as for the GEMM's copy, but a pair at a time into L2).
void tiled_rows_avx512(const WeightView& v, const float* x, int64_t rows, int64_t out_features, const float* bias,
                       float* out) {
  static constexpr auto kPairs = tile_kernels<2>(std::make_index_sequence<kTileRows>{});
  static constexpr auto kSingles = tile_kernels<1>(std::make_index_sequence<kTileRows>{});
  const int64_t in_features = v.in_features;
  const int64_t blocks = (out_features + kBlock - 1) / kBlock, pairs = (blocks + 1) / 2;
  const int64_t chunk_rows =
      std::max<int64_t>(1, kChunkBytes / (in_features * static_cast<int64_t>(sizeof(float))) / kTileRows) * kTileRows;
  // Stored bytes per input of an int8 / int4 block (int4: on average), for one prefetch per 64-byte line.
  const int64_t stride = v.format == kvik::kInt4 ? kBlock / 2 : kBlock, ahead = prefetch_ahead();
  const int64_t block_bytes = v.format == kvik::kInt4 ? int4_block_bytes(in_features) : in_features * kBlock;
  const auto widen = [&](int64_t block, int count, float* wide) {
    if (v.format == kvik::kBFloat16) {
      const auto* w = static_cast<const uint16_t*>(v.data) + block * in_features * kBlock;
      if (count == 2) return widen_blocks<2>(w, in_features * kBlock, in_features, wide);
      return widen_blocks<1>(w, 0, in_features, wide);
    }
    const auto* base = static_cast<const char*>(v.data);
    for (int64_t k = 0; k < in_features; ++k)
      for (int b = 0; b < count; ++b) {
        if (k * stride % 64 == 0)
          __builtin_prefetch(base + (block + b) * block_bytes + k * stride + ahead, 0, 1);
        dequantize_row_avx2(v, block + b, k, wide + (k * count + b) * kBlock);
      }
  };
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> wide(new float[2 * kBlock * in_features]);
    for (int64_t chunk = 0; chunk < rows; chunk += chunk_rows) {
      const int64_t chunk_end = std::min(rows, chunk + chunk_rows);
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t block = 2 * pair, first = block * kBlock;
        const bool both = block + 1 < blocks;
        const int64_t count = std::min<int64_t>(kBlock, out_features - (both ? first + kBlock : first));
        widen(block, both ? 2 : 1, wide.get());
        for (int64_t r = chunk; r < chunk_end; r += kTileRows) {
          const int64_t m = std::min<int64_t>(kTileRows, chunk_end - r);
          (both ? kPairs : kSingles)[m - 1](wide.get(), x + r * in_features, in_features,
                                            bias ? bias + first : nullptr, count, out + r * out_features + first,
                                            out_features);
        }
      }
    }
  });
}
#endif

#if KVIK_WEIGHT_ONLY_AVX2 && defined(__AVX512F__) && defined(__AVX512BF16__)
// Prompts on bfloat16 weights where the CPU multiplies bfloat16 (AVX512-BF16), in tiles of kTileRows
// rows by two blocks like the float32 tiles above: vdpbf16ps adds two products per float32 lane, so
// a tile reads each pair of inputs of a block as one 64-byte operand, row j's two weights side by
// side, against the pair of activations broadcast. The operands come
// from the stored block itself, interleaved once per call into a buffer that stays in L2 (one word
// permute per 64 bytes), not from a copy of the whole weight: the GEMM path this replaces copied
// every weight into a (K, N) matrix on each call and oneDNN reordered it again, a cost per call that
// a short prompt paid in full. The activations are rounded to bfloat16, as that path rounded them.
struct PairIndex {
  alignas(64) uint16_t words[32];
  constexpr PairIndex() : words() {
    for (int j = 0; j < 16; ++j) {
      words[2 * j] = static_cast<uint16_t>(j);            // input k, row j
      words[2 * j + 1] = static_cast<uint16_t>(16 + j);   // input k + 1, row j
    }
  }
};
constexpr PairIndex kPairIndex{};

// out[m][block b outputs] for M rows: xp holds each row's inputs as bfloat16 pairs (32-bit words),
// ops the interleaved operands (pairs x B blocks of 64 bytes).
template <int M, int B>
void tile_bf16dot(const __m512i* ops, const uint32_t* xp, int64_t pairs, int64_t x_stride, const float* bias,
                  int64_t count, float* out, int64_t out_stride) {
  __m512 acc[M][B];
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < B; ++b) acc[m][b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh w[B];
    for (int b = 0; b < B; ++b) w[b] = (__m512bh)_mm512_load_si512(ops + p * B + b);
#pragma GCC unroll 12
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[m * x_stride + p]));
      for (int b = 0; b < B; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], w[b], xv);
    }
  }
  for (int b = 0; b < B; ++b) {
    const __mmask16 mask = b + 1 < B ? __mmask16(0xffff) : static_cast<__mmask16>((1u << count) - 1);
    const __m512 add = bias ? _mm512_maskz_loadu_ps(mask, bias + b * kBlock) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(out + m * out_stride + b * kBlock, mask, _mm512_add_ps(acc[m][b], add));
  }
}

using Bf16TileKernel = void (*)(const __m512i*, const uint32_t*, int64_t, int64_t, const float*, int64_t, float*, int64_t);

template <int B, std::size_t... I>
constexpr std::array<Bf16TileKernel, sizeof...(I)> bf16dot_kernels(std::index_sequence<I...>) {
  return {&tile_bf16dot<static_cast<int>(I) + 1, B>...};
}

void tiled_rows_bf16dot(const WeightView& v, const float* x, int64_t rows, int64_t out_features, const float* bias,
                        float* out) {
  static constexpr auto kPairs = bf16dot_kernels<2>(std::make_index_sequence<kTileRows>{});
  static constexpr auto kSingles = bf16dot_kernels<1>(std::make_index_sequence<kTileRows>{});
  const int64_t in_features = v.in_features, pairs = (in_features + 1) / 2;
  const int64_t blocks = (out_features + kBlock - 1) / kBlock, block_pairs = (blocks + 1) / 2;
  // The rows as bfloat16 pairs, an odd last input paired with zero.
  std::vector<uint32_t> xp(rows * pairs, 0u);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      auto* dst = reinterpret_cast<c10::BFloat16*>(xp.data() + r * pairs);
      for (int64_t k = 0; k < in_features; ++k) dst[k] = c10::BFloat16(x[r * in_features + k]);
    }
  });
  const __m512i index = _mm512_load_si512(kPairIndex.words);
  const auto* data = static_cast<const uint16_t*>(v.data);
  at::parallel_for(0, block_pairs, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<__m512i[]> ops(new __m512i[pairs * 2]);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t block = 2 * pair, first = block * kBlock;
      const int nb = block + 1 < blocks ? 2 : 1;
      const int64_t count = std::min<int64_t>(kBlock, out_features - (first + (nb - 1) * kBlock));
      for (int b = 0; b < nb; ++b) {
        const uint16_t* w = data + (block + b) * in_features * kBlock;
        for (int64_t p = 0; p < pairs; ++p) {
          // Inputs 2p and 2p + 1 of the block are 64 contiguous bytes (an odd last one: 32 and zeros).
          const __m512i raw = 2 * p + 1 < in_features
              ? _mm512_loadu_si512(w + 2 * p * kBlock)
              : _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2 * p * kBlock)));
          _mm512_store_si512(ops.get() + p * nb + b, _mm512_permutexvar_epi16(index, raw));
        }
      }
      for (int64_t r = 0; r < rows; r += kTileRows) {
        const int64_t m = std::min<int64_t>(kTileRows, rows - r);
        (nb == 2 ? kPairs : kSingles)[m - 1](ops.get(), xp.data() + r * pairs, pairs, pairs,
                                             bias ? bias + first : nullptr, count, out + r * out_features + first,
                                             out_features);
      }
    }
  });
}
#define KVIK_BF16_DOT 1
#else
#define KVIK_BF16_DOT 0
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
#if KVIK_WEIGHT_ONLY_AVX2 && defined(__AVX512F__)
      if (vector) return block_bf16_avx512<M>(w, x, in_features, in_features, out);
#elif KVIK_WEIGHT_ONLY_AVX2
      if (vector) return block_bf16_avx2<M>(w, x, in_features, in_features, out);
#endif
      block_bf16<M>(w, x, in_features, in_features, out);
    });
  } else if (v.format == kvik::kInt8 && v.scales_f16) {
    const auto* w = static_cast<const int8_t*>(v.data) + block * in_features * kBlock;
    const c10::Half* s = v.scales_f16 + block * groups * kBlock;
    with_rows(rows, [&](auto m) {
      constexpr int M = decltype(m)::value;
#if KVIK_WEIGHT_ONLY_AVX2
      if (vector) return block_int8_grouped_avx2<M>(w, s, x, in_features, groups, in_features, group, out);
#endif
      block_int8_grouped<M>(w, s, x, in_features, groups, in_features, group, out);
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
    const auto* w = static_cast<const uint8_t*>(v.data) + block * int4_block_bytes(in_features);
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

// Whether this weight runs on int8 activations: the CPU has the instructions, neither the weight nor
// the process turned them off, and the inputs come in whole blocks of 32 (and int4 groups in whole
// blocks).
bool int8_dot(const WeightView& v) {
#if KVIK_INT8_DOT
  if (!v.allow_int8_activations || !int8_activations.load(std::memory_order_relaxed) ||
      portable_only.load(std::memory_order_relaxed))
    return false;
  if (v.in_features % kActBlock != 0) return false;
  return (v.format == kvik::kInt8 || v.format == kvik::kInt4) && v.group % kActBlock == 0;
#else
  (void)v;
  return false;
#endif
}

#if KVIK_INT8_DOT
// One block for all `rows` (1..kRows) quantized rows of a decode step (the weights streamed once,
// unpacked in registers).
void run_block_int8_dot(const WeightView& v, int64_t block, const QuantizedRows& x, int64_t rows,
                        float (*out)[kBlock]) {
  const int64_t in_features = v.in_features;
  const uint8_t* codes = x.codes.data();
  const float* act_scales = x.scales.data();
  const int32_t* correction = x.correction.data();
  if (v.format == kvik::kInt8) {
    const auto* w = static_cast<const int8_t*>(v.data) + block * in_features * kBlock;
    const c10::Half* group_scales = v.scales_f16 ? v.scales_f16 + block * v.groups * kBlock : nullptr;
    const float* row_scales = v.scales_f16 ? nullptr : v.scales_f32 + block * kBlock;
    with_rows(rows, [&](auto m) {
      constexpr int M = decltype(m)::value;
      if (group_scales)
        return block_int8_vnni<M, true>(w, nullptr, group_scales, codes, in_features, act_scales, correction,
                                        v.group, out);
      block_int8_vnni<M, false>(w, row_scales, nullptr, codes, in_features, act_scales, correction, 0, out);
    });
    return;
  }
  const auto* w = static_cast<const uint8_t*>(v.data) + block * int4_block_bytes(in_features);
  const c10::Half* s = v.scales_f16 + block * v.groups * kBlock;
  const c10::Half* o = v.offsets ? v.offsets + block * v.groups * kBlock : nullptr;
  const float* sums = x.group_sums.data();
  with_rows(rows, [&](auto m) {
    constexpr int M = decltype(m)::value;
    if (o) return block_int4_vnni<M, true>(w, s, o, codes, in_features, act_scales, sums, v.groups, v.group, out);
    block_int4_vnni<M, false>(w, s, o, codes, in_features, act_scales, sums, v.groups, v.group, out);
  });
}

// Rows r..r+rows-1 (1..kRows) of a prompt on NB (1 or 2) unpacked blocks, starting at `block`:
// tile_vnni for the weight's format.
template <int NB>
void run_tile_int8_dot(const WeightView& v, int64_t block, const __m512i* operands, int64_t operand_vectors,
                       const QuantizedRows& x, int64_t r, int64_t rows, float (*out)[kTileBlocks * kBlock]) {
  const int64_t in_features = v.in_features, blocks = in_features / kActBlock;
  const int64_t groups = v.format == kvik::kInt4 ? v.groups : 0;
  const TileRows tr{x.codes.data() + r * in_features, x.scales.data() + r * blocks, x.correction.data() + r * blocks,
                    groups ? x.group_sums.data() + r * groups : nullptr, in_features, v.groups, v.group};
  TileBlock tb[NB];
  for (int nb = 0; nb < NB; ++nb) {
    const int64_t at = (block + nb) * v.groups * kBlock;
    tb[nb] = TileBlock{operands + nb * operand_vectors, v.scales_f16 ? v.scales_f16 + at : nullptr,
                       v.offsets ? v.offsets + at : nullptr,
                       v.scales_f32 ? v.scales_f32 + (block + nb) * kBlock : nullptr};
  }
  with_rows(rows, [&](auto m) {
    constexpr int M = decltype(m)::value;
    if (v.format == kvik::kInt8) {
      if (v.scales_f16) return tile_vnni<M, NB, false, true, false>(tb, tr, out);
      return tile_vnni<M, NB, false, false, false>(tb, tr, out);
    }
    if (v.offsets) return tile_vnni<M, NB, true, true, true>(tb, tr, out);
    tile_vnni<M, NB, true, true, false>(tb, tr, out);
  });
}
#endif

// Whether `rows` rows of x on this weight run in the register tiles (AVX-512, float32 activations);
// rows = 0 asks whether a prompt would. Below the minimum the passes of four rows, widening in
// registers, were as fast or faster (5-12 rows: 10-30 % on bfloat16): the tiles first write a float32
// copy of each pair of blocks. int4 pays more per widening (nibbles, scales, offsets), which the passes
// do once per four rows and the tiles once per call: on the reference model's 48 linears (2 threads,
// an AVX-512 EPYC) the tiles took 0.88-0.90 of the passes' time at 9-11 rows and 0.78-0.83 at 12-15
// (8 rows: equal). Steps of 9-15 decodes on a pre-quantized int4 checkpoint served as it is run so.
bool float_tiles(const WeightView& v, int64_t rows) {
#if KVIK_WEIGHT_ONLY_AVX2 && defined(__AVX512F__)
  const int64_t min_rows = v.format == kvik::kInt4 ? 9 : 16;
  return (rows == 0 || rows >= min_rows) && !portable_only.load(std::memory_order_relaxed) && !int8_dot(v);
#else
  (void)v;
  (void)rows;
  return false;
#endif
}

// From one full tile of rows a bfloat16 weight's rows are rounded to bfloat16 and multiplied in
// bfloat16 (AVX512-BF16); fewer rows (decode steps of one to a few requests) keep float32
// activations. On the reference model's 48 linears (2 threads, an AVX512-BF16 EPYC) the tiles
// matched the passes of four at 12 rows (9.5-9.8 against 9.9 ms), were 3-6 % faster at 13-15 and
// took 0.85 / 0.80 / 0.72 of the passes' time at 16 / 20 / 32 rows, where the float32 tiles that
// ran those rows before took 1.6 / 1.3 / 1.2x the passes' time. It was 33 (prompts only) before.
#if KVIK_BF16_DOT
constexpr int64_t kBf16DotMinRows = kTileRows;
#endif

// Whether batches of kBf16DotMinRows+ rows on this weight multiply in bfloat16 (AVX512-BF16 builds, where it may).
bool bf16_dot_tiles(const WeightView& v) {
#if KVIK_BF16_DOT
  return v.format == kvik::kBFloat16 && v.allow_bf16_activations && !portable_only.load(std::memory_order_relaxed);
#else
  (void)v;
  return false;
#endif
}

}  // namespace

namespace kvik {

void check_linear_weight(const LinearWeight& weight) {
  TORCH_CHECK(weight.format == kBFloat16 || weight.format == kInt8 || weight.format == kInt4,
              "not a weight-only format: ", weight.format);
  const int64_t blocks = (weight.out_features + kBlock - 1) / kBlock;
  TORCH_CHECK(weight.data.defined() && weight.data.is_contiguous(), "weight data must be contiguous");
  const int64_t block_elements =
      weight.format == kvik::kInt4 ? int4_block_bytes(weight.in_features) : weight.in_features * kBlock;
  TORCH_CHECK(weight.data.numel() == blocks * block_elements, "weight data has ", weight.data.numel(),
              " elements, expected ", blocks * block_elements);
  TORCH_CHECK(weight.group >= 0, "group size must not be negative");
  if (weight.format == kvik::kInt8 && weight.group == 0) {
    TORCH_CHECK(weight.scales.scalar_type() == at::kFloat && weight.scales.numel() == blocks * kBlock,
                "int8 scales: float32, one per padded output row");
    TORCH_CHECK(!weight.offsets.defined(), "int8 weights have no offsets");
  } else if (weight.format == kvik::kInt8) {
    const int64_t groups = (weight.in_features + weight.group - 1) / weight.group;
    TORCH_CHECK(weight.scales.scalar_type() == at::kHalf && weight.scales.numel() == blocks * groups * kBlock,
                "int8 scales with groups: float16 (blocks, groups, 16)");
    TORCH_CHECK(!weight.offsets.defined(), "int8 weights have no offsets");
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

void check_linear_bias(const LinearWeight& weight) {
  if (weight.bias.has_value() && weight.bias->defined())
    TORCH_CHECK(weight.bias->is_contiguous() && weight.bias->numel() == weight.out_features &&
                    weight.bias->scalar_type() == at::kFloat,
                "bias must be float32 with out_features elements");
}

at::Tensor weight_only_linear(const at::Tensor& x, const LinearWeight& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "x must be a contiguous float32 (rows, in_features) tensor");
  TORCH_CHECK(x.size(1) == weight.in_features, "x has ", x.size(1), " features, the weight ",
              weight.in_features);
  check_linear_weight(weight);
  check_linear_bias(weight);
  at::Tensor out = at::empty({x.size(0), weight.out_features}, x.options());
  if (x.size(0) > 0) weight_only_linear_into(x.data_ptr<float>(), x.size(0), weight, out.data_ptr<float>());
  return out;
}

void weight_only_linear_into(const float* xp, int64_t rows, const LinearWeight& weight, float* op) {
  const int64_t in_features = weight.in_features, out_features = weight.out_features;
  const int64_t blocks = (out_features + kBlock - 1) / kBlock;
  const float* bias = weight.bias.has_value() && weight.bias->defined() ? weight.bias->data_ptr<float>() : nullptr;
  const WeightView view(weight);
  // Rows r..r+chunk-1 of one block's outputs, from columns `column`.. of acc's rows.
  const auto finish = [&](int64_t block, int64_t r, int64_t chunk, const auto& acc, int64_t column = 0) {
    const int64_t first = block * kBlock, count = std::min<int64_t>(kBlock, out_features - first);
    for (int64_t m = 0; m < chunk; ++m) {
      float* o = op + (r + m) * out_features + first;
      for (int64_t j = 0; j < count; ++j) o[j] = acc[m][column + j] + (bias ? bias[first + j] : 0.f);
    }
  };
#if KVIK_INT8_DOT
  if (int8_dot(view)) {
    // Reused across calls on this thread: a decode step makes four of these calls per layer, and
    // three fresh vectors each were a measurable part of a one-row call's fixed cost. Used through
    // a reference: a lambda naming a thread_local reads the running thread's own copy, and the
    // parallel tasks below must read this (the calling) thread's.
    thread_local QuantizedRows rows_buffer;
    QuantizedRows& quantized = rows_buffer;
    quantize_rows(xp, rows, in_features, weight.format == kInt4 ? weight.group : 0, quantized);
    // Decode steps (up to four rows) stream each block once, unpacked in registers; a prompt's
    // passes unpack each pair of blocks once (unpack_int4_block, unpack_int8_block) and run the
    // two-block tiles over it.
    const bool int4 = weight.format == kInt4;
    if (rows <= kRows) {
      kvik::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
        float acc[kRows][kBlock];
        for (int64_t block = begin; block < end; ++block) {
          run_block_int8_dot(view, block, quantized, rows, acc);
          finish(block, 0, rows, acc);
        }
      });
      return;
    }
    const int64_t operand_vectors = in_features / 4;  // one per 4 inputs
    const int64_t tiles = (blocks + kTileBlocks - 1) / kTileBlocks;
    // Every tile over all rows: a 2048-token step's codes (4 MiB at 2048 inputs) come from L3, and
    // rows in chunks that stay in L2 measured no faster (alternating builds, 2048 rows).
    kvik::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      float acc[kRows][kTileBlocks * kBlock];
      std::unique_ptr<__m512i[]> operands(new __m512i[kTileBlocks * operand_vectors]);
      for (int64_t tile = begin; tile < end; ++tile) {
        const int64_t block = kTileBlocks * tile, count = std::min<int64_t>(kTileBlocks, blocks - block);
        for (int64_t nb = 0; nb < count; ++nb) {
          if (int4)
            unpack_int4_block(static_cast<const uint8_t*>(view.data) + (block + nb) * int4_block_bytes(in_features),
                              in_features, operands.get() + nb * operand_vectors);
          else
            unpack_int8_block(static_cast<const int8_t*>(view.data) + (block + nb) * in_features * kBlock,
                              in_features, operands.get() + nb * operand_vectors);
        }
        for (int64_t r = 0; r < rows; r += kRows) {
          const int64_t chunk = std::min<int64_t>(kRows, rows - r);
          const auto run = [&](auto nb) {
            run_tile_int8_dot<decltype(nb)::value>(view, block, operands.get(), operand_vectors, quantized, r, chunk,
                                                   acc);
          };
          if (count == 2) run(std::integral_constant<int, 2>{});
          else run(std::integral_constant<int, 1>{});
          for (int64_t nb = 0; nb < count; ++nb) finish(block + nb, r, chunk, acc, nb * kBlock);
        }
      }
    });
    return;
  }
#endif
#if KVIK_BF16_DOT
  if (rows >= kBf16DotMinRows && bf16_dot_tiles(view)) {
    tiled_rows_bf16dot(view, xp, rows, out_features, bias, op);
    return;
  }
#endif
  if (float_tiles(view, rows)) {
#if KVIK_WEIGHT_ONLY_AVX2 && defined(__AVX512F__)
    tiled_rows_avx512(view, xp, rows, out_features, bias, op);
#endif
    return;
  }
  // int4: each row's sum over each group of inputs, for the groups' offsets.
  const int64_t groups = weight.format == kInt4 ? view.groups : 0;
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
  kvik::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    float acc[kRows][kBlock];
    for (int64_t block = begin; block < end; ++block) {
      // Rows in passes of four: the block's weights come from DRAM once, then from cache.
      for (int64_t r = 0; r < rows; r += kRows) {
        const int64_t chunk = std::min<int64_t>(kRows, rows - r);
        run_block(view, block, xp + r * in_features, chunk, x_sums.data() + r * groups, acc);
        finish(block, r, chunk, acc);
      }
    }
  });
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

// A greedy step needs one index from the LM head, not its logits. On a bfloat16 model the head is
// a large part of the step's bytes (a quarter on the 125M reference model: 32000 x 768), so the
// step reads the int8 copy instead (half the bytes) and computes from W only the outputs that could
// still be the largest. Why the answer is exact: let w' be the copy's values (scale x code, exact
// reals), e_j = max_i |w_ji - w'_ji|, M_j the larger of max |w_ji| and max |w'_ji|, and A_j the
// largest sum of |w'_ji| over a block of 32 inputs. Float32 sums of n products in any order are
// within about n 2^-24 sum_i |x_i| M_j of the true sums, FMA or not. Where the copy multiplies int8
// activations (VNNI), x_i becomes x'_i = code x s_b with s_b = max |x| over its block / 127 and
// |x_i - x'_i| <= 0.51 s_b, which moves output j by at most 0.51 A_j sum_b s_b. So the computed
// coarse and exact logits of output j differ by at most bound[0][j] |x|_1 + bound[1][j] sum_b s_b,
// with bound[0][j] = e_j + (rounding) M_j and bound[1][j] = 0.51 A_j, both rounded up
// (kvik.model.transforms.screened_head fills them). If j* has the largest exact logit, then for
// every j, exact(j*) >= exact(j) >= coarse(j) - bound_j, so coarse(j*) + bound_j* reaches the
// largest lower end: every output that passes that test is computed exactly, j* and every output
// tied with it included, and the first largest of those is the full argmax's answer (so is the
// first largest of any larger set of exact values: a pass of rows computes the union of its rows'
// blocks once, and each row compares all of them). The exact values come from the full product's
// own block functions on the same block and the same pass of rows (run_block; gemv_packed_block
// for a packed float32 head), so they are its bits, not just close to them. -ffast-math:
// finiteness is tested on the bits.
namespace {
inline bool finite_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return (bits & 0x7f800000u) != 0x7f800000u;
}
// bound[1] sums |w'| over blocks of this many inputs: the blocks int8 activations are rounded in.
constexpr int64_t kScreenBlock = 32;
#if KVIK_INT8_DOT
static_assert(kActBlock == kScreenBlock, "the screen's activation blocks are the kernels'");
#endif
inline bool finite_bits(double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return (bits & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
}
}  // namespace

std::tuple<at::Tensor, int64_t> screened_argmax(const at::Tensor& x, const LinearWeight& exact,
                                                const LinearWeight& coarse, const at::Tensor& bound) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) == exact.in_features,
              "x must be a contiguous float32 (rows, in_features) tensor");
  const auto has_bias = [](const LinearWeight& w) { return w.bias.has_value() && w.bias->defined(); };
  const bool packed = exact.format == kPackedFloat32;
  TORCH_CHECK((packed || exact.format == kBFloat16) && coarse.format == kInt8 && !has_bias(exact) &&
                  !has_bias(coarse) && coarse.out_features == exact.out_features &&
                  coarse.in_features == exact.in_features,
              "screening takes a packed float32 or bfloat16 weight and its int8 copy, neither with a bias");
  TORCH_CHECK(bound.dim() == 2 && bound.size(0) == 2 && bound.size(1) == exact.out_features &&
                  bound.is_contiguous() && bound.scalar_type() == at::kFloat,
              "bound must be a contiguous float32 (2, out_features) tensor");
  if (!packed) check_linear_weight(exact);
  check_linear_weight(coarse);
  const int64_t rows = x.size(0), n = exact.in_features, outputs = exact.out_features;
  // Outputs per exact block: the packed layout's block (16, 32 or 64), or kvik's 16.
  const int64_t width = packed ? exact.block : kBlock;
  std::optional<WeightView> view;
  if (!packed) view.emplace(exact);
  const auto full = [&] { return std::make_tuple(argmax_rows(exact(x)), int64_t{-1}); };
  // Only where the full product runs its passes of four rows (gemv_packed's block_rows, run_block).
  // A packed head's blocks are up to 64 outputs wide, so its exact blocks cost more: at 8 rows the
  // screen measured slower than the full product there (1.98 against 1.64 ms on the reference
  // head; at 4 rows 0.72 against 1.13), so it screens one pass of rows only.
  bool passes = rows > 0 && (packed ? rows <= kRows : !float_tiles(*view, rows));
  const bool int8_activations = int8_dot(WeightView(coarse));
#if KVIK_BF16_DOT
  passes = passes && (packed || !(rows >= kBf16DotMinRows && bf16_dot_tiles(*view)));
#endif
  if (!passes) return full();
  const at::Tensor coarse_logits = weight_only_linear(x, coarse);
  const float* c = coarse_logits.data_ptr<float>();
  const float* b = bound.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const int64_t blocks = (outputs + width - 1) / width;
  // Which blocks each pass of rows (the full product's passes of kRows) computes exactly: the
  // union of its rows' candidates (an exact value outside a row's candidates is still exact, so
  // comparing it too changes nothing).
  const int64_t passes_count = (rows + kRows - 1) / kRows;
  std::vector<char> marked(rows * blocks, 0);  // per row, then merged per pass
  std::atomic<bool> non_finite{false};
  kvik::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xt = xp + t * n;
      double l1 = 0.0, steps = 0.0;
      for (int64_t i = 0; i < n; ++i) l1 += std::abs(static_cast<double>(xt[i]));
      if (int8_activations)
        for (int64_t first = 0; first < n; first += kScreenBlock) {
          float amax = 0.f;
          for (int64_t i = first; i < std::min(n, first + kScreenBlock); ++i) amax = std::max(amax, std::abs(xt[i]));
          steps += static_cast<double>(amax) / 127.0;
        }
      if (!finite_bits(l1) || !finite_bits(steps)) {
        non_finite = true;
        return;
      }
      l1 *= 1.0 + 1e-9;  // the sums' own rounding: n additions in double
      steps *= 1.0 + 1e-9;
      const float* ct = c + t * outputs;
      const auto slack = [&](int64_t j) {
        return static_cast<double>(b[j]) * l1 + static_cast<double>(b[outputs + j]) * steps;
      };
      double lower = 0.0;
      for (int64_t j = 0; j < outputs; ++j) {
        if (!finite_bits(ct[j])) {
          non_finite = true;
          return;
        }
        const double low = static_cast<double>(ct[j]) - slack(j);
        lower = j == 0 ? low : std::max(lower, low);
      }
      char* flags = marked.data() + t * blocks;
      for (int64_t j = 0; j < outputs; ++j)
        if (static_cast<double>(ct[j]) + slack(j) >= lower) flags[j / width] = 1;
    }
  });
  if (non_finite) return full();
  // The exact blocks, each pass's in one call per block: the full product's calls.
  std::vector<std::pair<int64_t, int64_t>> work;  // (pass, block)
  for (int64_t pass = 0; pass < passes_count; ++pass)
    for (int64_t block = 0; block < blocks; ++block) {
      bool any = false;
      for (int64_t t = pass * kRows; t < std::min(rows, (pass + 1) * kRows); ++t) any = any || marked[t * blocks + block];
      if (any) work.emplace_back(pass, block);
    }
  std::vector<float> values(work.size() * kRows * width);
  kvik::parallel_for(0, static_cast<int64_t>(work.size()), 4, [&](int64_t begin, int64_t end) {
    float acc[kRows][kBlock];
    for (int64_t w = begin; w < end; ++w) {
      const int64_t first_row = work[w].first * kRows, chunk = std::min<int64_t>(kRows, rows - first_row);
      float* dst = values.data() + w * kRows * width;
      if (packed) {
        gemv_packed_block(xp + first_row * n, chunk, n, exact.address, exact.in_stride, width, work[w].second, dst);
      } else {
        run_block(*view, work[w].second, xp + first_row * n, chunk, nullptr, acc);
        std::memcpy(dst, acc, sizeof(acc));
      }
    }
  });
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t) {
    float best = 0.f;
    int64_t best_index = -1;
    for (size_t w = 0; w < work.size(); ++w) {  // blocks in ascending order within the pass
      if (work[w].first != t / kRows) continue;
      const int64_t first = work[w].second * width, count = std::min<int64_t>(width, outputs - first);
      const float* row = values.data() + (w * kRows + t % kRows) * width;
      for (int64_t j = 0; j < count; ++j) {
        if (!finite_bits(row[j])) return full();
        if (best_index < 0 || row[j] > best) {  // ascending indices: the first of equal values stays
          best = row[j];
          best_index = first + j;
        }
      }
    }
    o[t] = best_index;
  }
  const int64_t computed = static_cast<int64_t>(work.size());
  return std::make_tuple(out, computed);
}

at::Tensor LinearWeight::operator()(const at::Tensor& x) const {
  if (format == kPackedFloat32) return gemv_packed(x, address, out_features, in_stride, block, bias);
  return weight_only_linear(x, *this);
}

void LinearWeight::forward_into(const at::Tensor& x, at::Tensor& out) const {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) == in_features,
              "x must be a contiguous float32 (rows, in_features) tensor");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat && out.numel() == x.size(0) * out_features,
              "out must be a contiguous float32 (rows, out_features) tensor");
  if (x.size(0) == 0) return;
  if (format == kPackedFloat32)
    return gemv_packed_into(x.data_ptr<float>(), x.size(0), in_features, address, out_features, in_stride, block,
                            bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr,
                            out.data_ptr<float>());
  weight_only_linear_into(x.data_ptr<float>(), x.size(0), *this, out.data_ptr<float>());
}

void set_portable_kernels(bool portable) { portable_only.store(portable); }

void set_int8_activations(bool enabled) { int8_activations.store(enabled); }

int64_t weight_prefetch_bytes() { return prefetch_distance.load(); }

void set_weight_prefetch_bytes(int64_t bytes) {
  // The loops add it to addresses inside the weight and ask for lines that far on; a prefetch
  // never faults, but past a few pages it only evicts what the loop is about to read.
  TORCH_CHECK(bytes >= 0 && bytes <= (1 << 20), "the prefetch distance must be 0 to 1 MiB, not ", bytes);
  prefetch_distance.store(bytes);
}

bool uses_int8_activations(const LinearWeight& weight) {
  return weight.format != kPackedFloat32 && int8_dot(WeightView(weight));
}

bool uses_prompt_tiles(const LinearWeight& weight) {
  return weight.format != kPackedFloat32 && float_tiles(WeightView(weight), 0);
}

bool uses_bf16_prompt_tiles(const LinearWeight& weight) {
  return weight.format != kPackedFloat32 && bf16_dot_tiles(WeightView(weight));
}

const char* simd_isa() {
  if (portable_only.load()) return "portable";
#if KVIK_INT8_DOT
  if (int8_activations.load()) return "avx512-vnni (int8 activations for int8/int4 weights; bfloat16 on avx-512)";
#endif
#if KVIK_WEIGHT_ONLY_AVX2 && defined(__AVX512F__)
  return "avx2 (bfloat16 on avx-512)";
#elif KVIK_WEIGHT_ONLY_AVX2
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace kvik
