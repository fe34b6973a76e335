// Fused element-wise kernels for the CPU path (float32). Each replaces a chain of PyTorch ops that,
// at decode batch sizes, costs more in dispatch and memory passes than in arithmetic:
//   rms_norm            out = x * rsqrt(mean(x^2) + eps) * w                      (5 ops -> 1)
//   fused_add_rms_norm  residual += x; x = rms_norm(residual) * w, in place       (6 ops -> 1)
//   rotary_inplace      neox-style rotation of q and k heads by per-token cos/sin (~10 ops -> 1)
//   silu_and_mul        out = silu(gate) * up from the fused gate_up projection   (3 ops -> 1)
//   argmax_rows         each row's index of its largest value (greedy sampling and the sampled draw)
// Reductions accumulate in float like PyTorch's; results agree with the PyTorch path within float
// rounding.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGrain = 8;  // rows per parallel task: small rows, avoid scheduling overhead

inline float inv_rms(const float* x, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  return 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
}

// NaN test on the bits: the file is built with -ffast-math, under which std::isnan may fold to false.
inline bool is_nan(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

// torch.argmax's answer for one row: the first index of the largest value, or of the first NaN if
// there is one (PyTorch's max propagates NaN). PyTorch's own CPU argmax walks the row one element at
// a time, ~55 us for a 32000-entry vocabulary at one row and 1.1-1.7 ms for 16 rows on the 2-core
// AVX-512 machine: a few percent of every decode step. Here 16 lanes keep their own maximum and the
// index where it first appeared; ties between lanes go to the smallest index.
int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, best_index = 0;
  float best = x[0];
#if defined(__AVX512F__)
  if (n >= 32) {
    __m512 lane_best = _mm512_loadu_ps(x);
    __m512i lane_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i index = lane_index;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(lane_best, lane_best, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n; i += 16) {
      index = _mm512_add_epi32(index, step);
      const __m512 v = _mm512_loadu_ps(x + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 greater = _mm512_cmp_ps_mask(v, lane_best, _CMP_GT_OQ);  // strictly: first wins
      lane_best = _mm512_mask_mov_ps(lane_best, greater, v);
      lane_index = _mm512_mask_mov_epi32(lane_index, greater, index);
    }
    if (nan) {
      for (int64_t k = 0; k < i; ++k)
        if (is_nan(x[k])) return k;
    }
    best = _mm512_reduce_max_ps(lane_best);
    const __mmask16 at_best = _mm512_cmp_ps_mask(lane_best, _mm512_set1_ps(best), _CMP_EQ_OQ);
    best_index = _mm512_mask_reduce_min_epi32(at_best, lane_index);
  }
#endif
  for (; i < n; ++i) {
    if (is_nan(x[i])) return i;
    if (x[i] > best) {
      best = x[i];
      best_index = i;
    }
  }
  return best_index;
}

}  // namespace

namespace kvik {

at::Tensor argmax_rows(const at::Tensor& values) {
  TORCH_CHECK(values.dim() == 2 && values.size(1) > 0 && values.scalar_type() == at::kFloat &&
                  values.is_contiguous(),
              "argmax_rows takes a contiguous float32 (rows, n) tensor with n > 0");
  const int64_t rows = values.size(0), n = values.size(1);
  at::Tensor out = at::empty({rows}, values.options().dtype(at::kLong));
  const float* x = values.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(x + r * n, n);
  });
  return out;
}

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && weight.is_contiguous(), "contiguous inputs");
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * n;
      float* orow = op + r * n;
      const float scale = inv_rms(xr, n, static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) orow[i] = wp[i] * (xr[i] * scale);
    }
  });
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(),
              "contiguous inputs");
  const int64_t n = x.size(-1), rows = x.numel() / n;
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = xp + r * n;
      float* rr = rp + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) rr[i] = xr[i] + rr[i];
      const float scale = inv_rms(rr, n, static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) xr[i] = wp[i] * (rr[i] * scale);
    }
  });
}

void rotary_rows(float* base, int64_t begin, int64_t end, int64_t heads, int64_t dim, int64_t row_stride,
                 int64_t head_stride, const float* cos, const float* sin) {
  const int64_t half = dim / 2;
  for (int64_t t = begin; t < end; ++t) {
    const float* c = cos + t * dim;
    const float* s = sin + t * dim;
    for (int64_t h = 0; h < heads; ++h) {
      float* x = base + t * row_stride + h * head_stride;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i + half] + x1 * s[i + half];
      }
    }
  }
}

// qk: (T, heads, D) view whose last dimension is contiguous and whose heads are `head_stride`
// apart, with rows `row_stride` apart (q and k heads side by side in the qkv projection output).
// cos, sin: (T, D) contiguous, the two halves of each row equal.
void rotary_inplace(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(qk.stride(-1) == 1 && cos.is_contiguous() && sin.is_contiguous(), "layout");
  const int64_t tokens = qk.size(0), heads = qk.size(1), dim = qk.size(2);
  const int64_t row_stride = qk.stride(0), head_stride = qk.stride(1);
  float* base = qk.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, tokens, kGrain, [&](int64_t begin, int64_t end) {
    rotary_rows(base, begin, end, heads, dim, row_stride, head_stride, cp, sp);
  });
}

void silu_and_mul(at::Tensor& out, const at::Tensor& gate_up) {
  TORCH_CHECK(out.is_contiguous() && gate_up.is_contiguous(), "contiguous inputs");
  const int64_t inter = out.size(-1), rows = out.numel() / inter;
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = gp + r * 2 * inter;
      const float* up = gate + inter;
      float* o = op + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
}

}  // namespace kvik
