// Small-batch matrix-vector product straight on oneDNN's packed weights (CPU, float32).
//
// Decoding a few sequences is bound by how fast the weights stream from memory. oneDNN's
// kernels for so few rows stream them at about 60-70 % of what a plain reduction reaches on the same
// machine; this kernel reaches about the reduction's speed. It reads the layout oneDNN already
// chose for the batched GEMMs (so the weights are held once): blocks of `B` output rows, each block
// stored input-major, [in_stride][B], with B consecutive outputs per input element. That is one
// sequential stream per block, and each input element is one broadcast FMA into B accumulators.
// Python checks the layout on the real shapes before using this (onednn_linear.py), and falls back
// to oneDNN when it differs.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <type_traits>

#include "decode_team.h"
#include "kernels.h"

namespace {

// One block of B output rows for M rows of x: out[m][j] = sum_k W[j][k] x[m][k] (+ bias). The
// M x B accumulators stay in registers up to four rows (kRowsPerPass).
template <int M, int B>
inline void block_rows(float* out, const float* x, const float* wb, const float* bias, int64_t first,
                       int64_t out_features, int64_t in_features) {
  float acc[M][B];
  for (int m = 0; m < M; ++m) {
#pragma omp simd
    for (int j = 0; j < B; ++j) acc[m][j] = 0.f;
  }
  for (int64_t k = 0; k < in_features; ++k) {
    const float* wk = wb + k * B;
    // The block is one sequential stream; ask for its lines ahead, as the weight-only kernels do.
    for (int line = 0; line < B * 4 / 64; ++line)
      __builtin_prefetch(reinterpret_cast<const char*>(wk) + kvik::kWeightPrefetchBytes + 64 * line, 0, 1);
    for (int m = 0; m < M; ++m) {
      const float xv = x[m * in_features + k];
#pragma omp simd
      for (int j = 0; j < B; ++j) acc[m][j] += wk[j] * xv;
    }
  }
  // The last block may be padded past out_features: those lanes are computed and dropped.
  const int64_t count = std::min<int64_t>(B, out_features - first);
  for (int m = 0; m < M; ++m) {
    float* o = out + m * out_features + first;
    for (int64_t j = 0; j < count; ++j) o[j] = acc[m][j] + (bias ? bias[first + j] : 0.f);
  }
}

constexpr int64_t kRowsPerPass = 4;

// Rows beyond four take further passes over the same block while it is still in cache (a block is
// at most 64 x in_stride floats: 512 KiB for a 2048-wide input), so the weights stream from memory
// once per call whatever the row count. The later passes cost arithmetic and cache reads only,
// which is why this still beats oneDNN's small-batch GEMM a few rows past four (measured in
// onednn_linear.py). Splitting a 64-lane block into lane groups for eight rows in one pass
// measured much slower (strided reads).
template <int B>
void gemv_block(int64_t rows, float* out, const float* x, const float* w, const float* bias,
                int64_t out_features, int64_t in_features, int64_t in_stride) {
  const int64_t blocks = (out_features + B - 1) / B;
  kvik::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const float* wb = w + block * in_stride * B;
      const int64_t first = block * B;
      for (int64_t r = 0; r < rows; r += kRowsPerPass) {
        float* o = out + r * out_features;
        const float* xr = x + r * in_features;
        switch (std::min<int64_t>(kRowsPerPass, rows - r)) {
          case 1: block_rows<1, B>(o, xr, wb, bias, first, out_features, in_features); break;
          case 2: block_rows<2, B>(o, xr, wb, bias, first, out_features, in_features); break;
          case 3: block_rows<3, B>(o, xr, wb, bias, first, out_features, in_features); break;
          default: block_rows<4, B>(o, xr, wb, bias, first, out_features, in_features); break;
        }
      }
    }
  });
}

}  // namespace

namespace kvik {

// weight_address: the packed buffer (torch.ops.mkldnn.data_ptr of the prepacked weight, which the
// caller keeps alive), ceil(out_features / block) * block * in_stride floats.
at::Tensor gemv_packed(const at::Tensor& x, int64_t weight_address, int64_t out_features,
                          int64_t in_stride, int64_t block, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "x must be a contiguous float32 [rows, in_features] tensor");
  const int64_t rows = x.size(0), in_features = x.size(1);
  TORCH_CHECK(in_stride >= in_features, "in_stride smaller than in_features");
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == out_features, "bias must have out_features");
    bias_ptr = bias->data_ptr<float>();
  }
  auto out = at::empty({rows, out_features}, x.options());
  gemv_packed_into(x.data_ptr<float>(), rows, in_features, weight_address, out_features, in_stride, block, bias_ptr,
                   out.data_ptr<float>());
  return out;
}

void gemv_packed_into(const float* x, int64_t rows, int64_t in_features, int64_t weight_address,
                      int64_t out_features, int64_t in_stride, int64_t block, const float* bias, float* out) {
  const auto* w = reinterpret_cast<const float*>(weight_address);
  switch (block) {
    case 16: gemv_block<16>(rows, out, x, w, bias, out_features, in_features, in_stride); break;
    case 32: gemv_block<32>(rows, out, x, w, bias, out_features, in_features, in_stride); break;
    case 64: gemv_block<64>(rows, out, x, w, bias, out_features, in_features, in_stride); break;
    default: TORCH_CHECK(false, "unsupported block of ", block, " output rows");
  }
}

void gemv_packed_block(const float* x, int64_t rows, int64_t in_features, int64_t weight_address, int64_t in_stride,
                       int64_t block, int64_t index, float* out) {
  const auto* w = reinterpret_cast<const float*>(weight_address);
  const auto run = [&](auto b) {
    constexpr int B = decltype(b)::value;
    const float* wb = w + index * in_stride * B;
    // out_features = B and first = 0: every lane written to out's row of B, as the pass computes it.
    switch (rows) {
      case 1: return block_rows<1, B>(out, x, wb, nullptr, 0, B, in_features);
      case 2: return block_rows<2, B>(out, x, wb, nullptr, 0, B, in_features);
      case 3: return block_rows<3, B>(out, x, wb, nullptr, 0, B, in_features);
      default: return block_rows<4, B>(out, x, wb, nullptr, 0, B, in_features);
    }
  };
  TORCH_CHECK(rows >= 1 && rows <= kRowsPerPass, "a pass takes 1 to ", kRowsPerPass, " rows");
  switch (block) {
    case 16: return run(std::integral_constant<int, 16>{});
    case 32: return run(std::integral_constant<int, 32>{});
    case 64: return run(std::integral_constant<int, 64>{});
    default: TORCH_CHECK(false, "unsupported block of ", block, " output rows");
  }
}

at::Tensor unpack_packed_float32(int64_t weight_address, int64_t out_features, int64_t in_features,
                                 int64_t in_stride, int64_t block) {
  TORCH_CHECK(weight_address != 0 && in_stride >= in_features && out_features > 0 && block > 0, "not a packed weight");
  const auto* w = reinterpret_cast<const float*>(weight_address);
  at::Tensor out = at::empty({out_features, in_features}, at::TensorOptions().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, out_features, 256, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const float* wb = w + (j / block) * in_stride * block + j % block;
      for (int64_t k = 0; k < in_features; ++k) o[j * in_features + k] = wb[k * block];
    }
  });
  return out;
}

}  // namespace kvik
