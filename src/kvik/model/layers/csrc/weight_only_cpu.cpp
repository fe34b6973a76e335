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
// The loops are plain C++ that GCC vectorises for the machine it is built on (-march=native at first
// use: AVX2 + FMA here, AVX-512 where the CPU has it, scalar code elsewhere); nothing assumes an
// instruction set at package build time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace {

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

// One block for `rows` (1..kRows) rows of x starting at x.
void run_block(const kvik::LinearWeight& weight, int64_t block, const float* x, int64_t rows,
               const float* x_sums, int64_t groups, float (&out)[kRows][kBlock]) {
  const int64_t in_features = weight.in_features;
#define KVIK_DISPATCH_ROWS(CALL) \
  switch (rows) {                \
    case 1: CALL(1); break;      \
    case 2: CALL(2); break;      \
    case 3: CALL(3); break;      \
    default: CALL(4); break;     \
  }
  switch (weight.format) {
    case kvik::kBFloat16: {
      const auto* w = reinterpret_cast<const uint16_t*>(weight.data.data_ptr()) + block * in_features * kBlock;
#define KVIK_CALL(M) block_bf16<M>(w, x, in_features, in_features, out)
      KVIK_DISPATCH_ROWS(KVIK_CALL)
#undef KVIK_CALL
      break;
    }
    case kvik::kInt8: {
      const auto* w = weight.data.data_ptr<int8_t>() + block * in_features * kBlock;
      const float* s = weight.scales.data_ptr<float>() + block * kBlock;
#define KVIK_CALL(M) block_int8<M>(w, s, x, in_features, in_features, out)
      KVIK_DISPATCH_ROWS(KVIK_CALL)
#undef KVIK_CALL
      break;
    }
    case kvik::kInt4: {
      const auto* w = weight.data.data_ptr<uint8_t>() + block * in_features * (kBlock / 2);
      const auto* s = weight.scales.data_ptr<c10::Half>() + block * groups * kBlock;
      if (weight.offsets.defined()) {
        const auto* o = weight.offsets.data_ptr<c10::Half>() + block * groups * kBlock;
#define KVIK_CALL(M) block_int4<M, true>(w, s, o, x, in_features, x_sums, groups, in_features, weight.group, out)
        KVIK_DISPATCH_ROWS(KVIK_CALL)
#undef KVIK_CALL
      } else {
#define KVIK_CALL(M) block_int4<M, false>(w, s, nullptr, x, in_features, x_sums, groups, in_features, weight.group, out)
        KVIK_DISPATCH_ROWS(KVIK_CALL)
#undef KVIK_CALL
      }
      break;
    }
    default:
      TORCH_CHECK(false, "not a weight-only format: ", weight.format);
  }
#undef KVIK_DISPATCH_ROWS
}

}  // namespace

namespace kvik {

void check_linear_weight(const LinearWeight& weight) {
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
  // int4: each row's sum over each group of inputs, for the groups' offsets.
  int64_t groups = 0;
  std::vector<float> x_sums;
  if (weight.format == kInt4) {
    groups = (in_features + weight.group - 1) / weight.group;
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
        run_block(weight, block, xp + r * in_features, chunk, x_sums.data() + r * groups, groups, acc);
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
  const int64_t groups = weight.format == kInt4 ? (in_features + weight.group - 1) / weight.group : 0;
  at::Tensor out = at::empty({in_features, out_features},
                             weight.data.options().dtype(bfloat16 ? at::kBFloat16 : at::kFloat));
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    float row[kBlock];
    for (int64_t block = begin; block < end; ++block) {
      const int64_t first = block * kBlock, count = std::min<int64_t>(kBlock, out_features - first);
      for (int64_t k = 0; k < in_features; ++k) {
        switch (weight.format) {
          case kBFloat16: {
            const auto* w = reinterpret_cast<const uint16_t*>(weight.data.data_ptr()) +
                            (block * in_features + k) * kBlock;
            for (int j = 0; j < kBlock; ++j) row[j] = bf16_to_float(w[j]);
            break;
          }
          case kInt8: {
            const int8_t* w = weight.data.data_ptr<int8_t>() + (block * in_features + k) * kBlock;
            const float* s = weight.scales.data_ptr<float>() + block * kBlock;
            for (int j = 0; j < kBlock; ++j) row[j] = static_cast<float>(w[j]) * s[j];
            break;
          }
          default: {  // kInt4
            const uint8_t* w = weight.data.data_ptr<uint8_t>() + (block * in_features + k) * (kBlock / 2);
            const int64_t at = (block * groups + k / weight.group) * kBlock;
            const c10::Half* s = weight.scales.data_ptr<c10::Half>() + at;
            const c10::Half* o = weight.offsets.defined() ? weight.offsets.data_ptr<c10::Half>() + at : nullptr;
            for (int j = 0; j < kBlock; ++j) {
              const int nibble = j < kBlock / 2 ? (w[j] & 15) : (w[j - kBlock / 2] >> 4);
              const float scale = static_cast<float>(s[j]);
              row[j] = static_cast<float>(nibble) * scale + (o ? static_cast<float>(o[j]) : -8.f * scale);
            }
          }
        }
        if (bfloat16) {
          auto* dst = out.data_ptr<c10::BFloat16>() + k * out_features + first;
          for (int64_t j = 0; j < count; ++j) dst[j] = c10::BFloat16(row[j]);
        } else {
          std::memcpy(out.data_ptr<float>() + k * out_features + first, row, count * sizeof(float));
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

const char* simd_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#elif defined(__ARM_NEON)
  return "neon";
#else
  return "generic";
#endif
}

}  // namespace kvik
