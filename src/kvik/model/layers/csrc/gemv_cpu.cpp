// Small-batch matrix-vector product straight on oneDNN's packed weights (CPU, float32).
//
// Decoding one to four sequences is bound by how fast the weights stream from memory. oneDNN's
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

#include "kernels.h"

namespace {

template <int M, int B>
void gemv_rows(float* out, const float* x, const float* w, const float* bias, int64_t out_features,
               int64_t in_features, int64_t in_stride) {
  const int64_t blocks = (out_features + B - 1) / B;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const float* wb = w + block * in_stride * B;
      float acc[M][B];
      for (int m = 0; m < M; ++m) {
#pragma omp simd
        for (int j = 0; j < B; ++j) acc[m][j] = 0.f;
      }
      for (int64_t k = 0; k < in_features; ++k) {
        const float* wk = wb + k * B;
        for (int m = 0; m < M; ++m) {
          const float xv = x[m * in_features + k];
#pragma omp simd
          for (int j = 0; j < B; ++j) acc[m][j] += wk[j] * xv;
        }
      }
      // The last block may be padded past out_features: those lanes are computed and dropped.
      const int64_t first = block * B;
      const int64_t count = std::min<int64_t>(B, out_features - first);
      for (int m = 0; m < M; ++m) {
        float* o = out + m * out_features + first;
        for (int64_t j = 0; j < count; ++j) o[j] = acc[m][j] + (bias ? bias[first + j] : 0.f);
      }
    }
  });
}

template <int B>
void gemv_block(int64_t rows, float* out, const float* x, const float* w, const float* bias,
                int64_t out_features, int64_t in_features, int64_t in_stride) {
  switch (rows) {
    case 1: return gemv_rows<1, B>(out, x, w, bias, out_features, in_features, in_stride);
    case 2: return gemv_rows<2, B>(out, x, w, bias, out_features, in_features, in_stride);
    case 3: return gemv_rows<3, B>(out, x, w, bias, out_features, in_features, in_stride);
    case 4: return gemv_rows<4, B>(out, x, w, bias, out_features, in_features, in_stride);
    default: TORCH_CHECK(false, "gemv_packed handles 1 to 4 rows, got ", rows);
  }
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
  const auto* w = reinterpret_cast<const float*>(weight_address);
  float* o = out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  switch (block) {
    case 16: gemv_block<16>(rows, o, xp, w, bias_ptr, out_features, in_features, in_stride); break;
    case 32: gemv_block<32>(rows, o, xp, w, bias_ptr, out_features, in_features, in_stride); break;
    case 64: gemv_block<64>(rows, o, xp, w, bias_ptr, out_features, in_features, in_stride); break;
    default: TORCH_CHECK(false, "unsupported block of ", block, " output rows");
  }
  return out;
}

}  // namespace kvik
