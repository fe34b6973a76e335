// Causal attention for a prompt chunk on the CPU (prefill), with AVX-512: a flash-attention pass
// that computes only the scores the causal mask keeps and reads each key and value once for all the
// query heads that share it (GQA).
//
// Shapes (float32 or bfloat16, all one dtype; the last dimension contiguous, the others any stride):
//   query  (n, H, D)   the chunk's n query tokens
//   key    (L, Hkv, D) every key the chunk attends: L - n tokens of context, then its own
//   value  (L, Hkv, D)
//   out    (n, H, D)
// Query token i sits at position L - n + i and attends keys 0 ... L - n + i.
//
// Why not PyTorch's SDPA: its CPU flash kernel computes a 64-row query block against the whole key
// range up to the block's diagonal in one piece, then masks; runs the small products through a
// generic GEMM per (head, block); and does each query head of a group on its own. On the 125M
// reference model a 512-token prompt spent a quarter of its prefill (80 of 317 ms) there, at ~60
// GFLOP/s. Here a work item is (kv head, 64 query tokens): its G x 64 query rows go through the
// keys 32 at a time (the scores as a small GEMM against a transposed copy of the tile, an online
// softmax per row, then the weighted values with the accumulators in registers), and tiles wholly
// past the diagonal are never touched: 2x SDPA up to 512 tokens, 1.2-1.45x at 1024 (12 query / 4
// KV heads, 2 threads).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kernels.h"

namespace {

#if defined(__AVX512F__)
constexpr int64_t kQueryBlock = 64;  // query tokens per work item (32: the same up to 512 tokens, slower at 1024)
constexpr int64_t kKeyTile = 32;     // keys per step of the pass (two vectors of scores a row)
constexpr int kScoreRows = 6;        // rows per score micro-tile: 12 accumulators + 2 key vectors

// Inputs in float32, or bfloat16 (a model run in bfloat16): widened on load, the arithmetic in float32
// as in SDPA's bfloat16 kernel, the output rounded to bfloat16 (nearest even) at the end.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  alignas(64) float values[16];
  _mm512_store_ps(values, v);
  for (int i = 0; i < 16; ++i) p[i] = c10::BFloat16(values[i]);
}

// e^x for x <= 0 (scores minus their running peak), ~1 ulp: 2^n * e^r with n = round(x / ln 2)
// and a degree-6 polynomial for e^r on [-ln2 / 2, ln2 / 2]. x is clamped to [-87, 0] (masked lanes
// may hold anything; their results are dropped).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_setzero_ps());
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// scores[r][0..31] = q_r . k_j for R rows (q already scaled) against a 32-key tile transposed as
// kt[d * 32 + j]. The keys past `count` are zero in kt; the caller masks them.
template <int R>
inline void tile_scores(const float* q, int64_t dim, const float* kt, float* scores) {
  __m512 a[R][2];
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    const __m512 k0 = _mm512_loadu_ps(kt + d * kKeyTile), k1 = _mm512_loadu_ps(kt + d * kKeyTile + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(q[r * dim + d]);
      a[r][0] = _mm512_fmadd_ps(b, k0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(b, k1, a[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(scores + r * kKeyTile, a[r][0]);
    _mm512_storeu_ps(scores + r * kKeyTile + 16, a[r][1]);
  }
}

// acc[r] += sum_j w[r][j] * v_j for R rows over `count` keys; v_j at value + j * v_stride.
template <int V, int R, typename T>
inline void tile_values(const float* w, const T* value, int64_t v_stride, int64_t count, float* acc) {
  constexpr int64_t dim = 16 * V;
  __m512 a[R][V];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c) a[r][c] = _mm512_loadu_ps(acc + r * dim + 16 * c);
  for (int64_t j = 0; j < count; ++j) {
    __m512 v[V];
    for (int c = 0; c < V; ++c) v[c] = load16(value + j * v_stride + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(w[r * kKeyTile + j]);
      for (int c = 0; c < V; ++c) a[r][c] = _mm512_fmadd_ps(b, v[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c) _mm512_storeu_ps(acc + r * dim + 16 * c, a[r][c]);
}

// Rows of the weighted sum at a time: at most 24 accumulators.
template <int V>
constexpr int value_rows() { return std::min(8, std::max(1, 24 / V)); }

struct Strides {
  int64_t q_token, q_head, k_token, k_head, v_token, v_head, o_token, o_head;
};

// One work item: the query tokens [p0, p1) of the chunk for every query head of KV head `h`.
template <int V, typename T>
void attend_block(const T* query, const T* key, const T* value, T* out, const Strides& s,
                  int64_t h, int64_t group, int64_t p0, int64_t p1, int64_t offset, float scale,
                  std::vector<float>& buffer) {
  constexpr int64_t dim = 16 * V;
  const int64_t tokens = p1 - p0, rows = tokens * group;
  const int64_t limit = offset + p1;  // keys this item attends: [0, limit)
  buffer.resize(rows * dim * 2 + rows * kKeyTile + dim * kKeyTile + rows * 2);
  float* q = buffer.data();              // rows x dim, scaled; row = token * group + head in group
  float* acc = q + rows * dim;           // rows x dim
  float* scores = acc + rows * dim;      // rows x 32
  float* kt = scores + rows * kKeyTile;  // dim x 32
  float* peak = kt + dim * kKeyTile;
  float* total = peak + rows;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const T* src = query + (p0 + t) * s.q_token + (h * group + g) * s.q_head;
      float* dst = q + (t * group + g) * dim;
      for (int c = 0; c < V; ++c) _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(vscale, load16(src + 16 * c)));
    }
  std::fill(acc, acc + rows * dim, 0.f);
  std::fill(peak, peak + rows, std::numeric_limits<float>::lowest());
  std::fill(total, total + rows, 0.f);
  const T* k_head = key + h * s.k_head;
  const T* v_head = value + h * s.v_head;
  for (int64_t k0 = 0; k0 < limit; k0 += kKeyTile) {
    const int64_t count = std::min(kKeyTile, limit - k0);
    for (int64_t j = 0; j < kKeyTile; ++j)
      for (int64_t d = 0; d < dim; ++d) kt[d * kKeyTile + j] = j < count ? widen(k_head[(k0 + j) * s.k_token + d]) : 0.f;
    int64_t r = 0;
    for (; r + kScoreRows <= rows; r += kScoreRows) tile_scores<kScoreRows>(q + r * dim, dim, kt, scores + r * kKeyTile);
    for (; r < rows; ++r) tile_scores<1>(q + r * dim, dim, kt, scores + r * kKeyTile);
    // The online softmax, row by row: keys past the row's own position (or past the tile) get no
    // weight.
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t position = offset + p0 + row / group;
      const int64_t allowed = std::min(count, position - k0 + 1);  // >= 1: key 0 <= every position
      float* w = scores + row * kKeyTile;
      if (allowed <= 0) {
        std::fill(w, w + kKeyTile, 0.f);
        continue;
      }
      const __mmask16 m0 = allowed >= 16 ? 0xffff : static_cast<__mmask16>((1u << allowed) - 1);
      const __mmask16 m1 = allowed >= 32 ? 0xffff : allowed <= 16 ? 0 : static_cast<__mmask16>((1u << (allowed - 16)) - 1);
      const __m512 s0 = _mm512_loadu_ps(w), s1 = _mm512_loadu_ps(w + 16);
      const __m512 lowest = _mm512_set1_ps(std::numeric_limits<float>::lowest());
      const float high = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_mov_ps(lowest, m0, s0),
                                                            _mm512_mask_mov_ps(lowest, m1, s1)));
      const float next = std::max(peak[row], high);
      const __m512 vnext = _mm512_set1_ps(next);
      const __m512 e0 = _mm512_maskz_mov_ps(m0, exp_nonpositive(_mm512_sub_ps(s0, vnext)));
      const __m512 e1 = _mm512_maskz_mov_ps(m1, exp_nonpositive(_mm512_sub_ps(s1, vnext)));
      _mm512_storeu_ps(w, e0);
      _mm512_storeu_ps(w + 16, e1);
      const float rescale = std::exp(peak[row] - next);
      total[row] = total[row] * rescale + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
      peak[row] = next;
      if (rescale != 1.f) {
        const __m512 factor = _mm512_set1_ps(rescale);
        for (int c = 0; c < V; ++c)
          _mm512_storeu_ps(acc + row * dim + 16 * c, _mm512_mul_ps(factor, _mm512_loadu_ps(acc + row * dim + 16 * c)));
      }
    }
    constexpr int R = value_rows<V>();
    const T* vt = v_head + k0 * s.v_token;
    r = 0;
    for (; r + R <= rows; r += R) tile_values<V, R>(scores + r * kKeyTile, vt, s.v_token, count, acc + r * dim);
    for (; r < rows; ++r) tile_values<V, 1>(scores + r * kKeyTile, vt, s.v_token, count, acc + r * dim);
  }
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t row = t * group + g;
      const __m512 inverse = _mm512_set1_ps(1.f / total[row]);
      T* dst = out + (p0 + t) * s.o_token + (h * group + g) * s.o_head;
      for (int c = 0; c < V; ++c) store16(dst + 16 * c, _mm512_mul_ps(inverse, _mm512_loadu_ps(acc + row * dim + 16 * c)));
    }
}

template <int V, typename T>
void prefill_attention_impl(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            at::Tensor& out, double scale) {
  const int64_t n = query.size(0), heads = query.size(1), length = key.size(0), kv_heads = key.size(1);
  const int64_t group = heads / kv_heads, offset = length - n;
  const Strides s{query.stride(0), query.stride(1), key.stride(0), key.stride(1),
                  value.stride(0), value.stride(1), out.stride(0), out.stride(1)};
  const T* q = query.data_ptr<T>();
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  T* o = out.data_ptr<T>();
  // Items from the most work to the least (the last query blocks attend the most keys), claimed
  // one at a time: the threads finish together however the causal work is spread.
  const int64_t blocks = (n + kQueryBlock - 1) / kQueryBlock, items = blocks * kv_heads;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer;
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t item = next.fetch_add(1); item < items; item = next.fetch_add(1)) {
        const int64_t block = blocks - 1 - item / kv_heads, h = item % kv_heads;
        const int64_t p0 = block * kQueryBlock, p1 = std::min(n, p0 + kQueryBlock);
        attend_block<V, T>(q, k, v, o, s, h, group, p0, p1, offset, static_cast<float>(scale), buffer);
      }
    }
  });
}
#endif

}  // namespace

namespace kvik {

bool prefill_attention_supported(int64_t head_dim) {
#if defined(__AVX512F__)
  return head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128;
#else
  (void)head_dim;
  return false;
#endif
}

void prefill_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, at::Tensor& out,
                       double scale) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3 && out.dim() == 3,
              "prefill_attention takes query (n, H, D), key and value (L, Hkv, D) and out (n, H, D)");
  for (const at::Tensor* t : {&query, &key, &value, static_cast<const at::Tensor*>(&out)}) {
    TORCH_CHECK((t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16) &&
                    t->scalar_type() == query.scalar_type() && t->device().is_cpu() && t->stride(2) == 1,
                "prefill_attention: float32 or bfloat16 CPU tensors, all of one dtype, with a contiguous last "
                "dimension");
  }
  const int64_t n = query.size(0), heads = query.size(1), dim = query.size(2);
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(2) == dim && key.size(0) >= n,
              "prefill_attention: key and value (L, Hkv, D) with L >= the query tokens");
  TORCH_CHECK(key.size(1) > 0 && heads % key.size(1) == 0, "prefill_attention: H must be a multiple of Hkv");
  TORCH_CHECK(out.sizes() == query.sizes(), "prefill_attention: out must have the query's shape");
  TORCH_CHECK(prefill_attention_supported(dim), "prefill_attention: head_dim ", dim,
              " is not supported here (AVX-512 and head_dim 16, 32, 64 or 128)");
  if (n == 0) return;
#if defined(__AVX512F__)
  const auto run = [&](auto element) {
    using T = decltype(element);
    switch (dim) {
      case 16: prefill_attention_impl<1, T>(query, key, value, out, scale); break;
      case 32: prefill_attention_impl<2, T>(query, key, value, out, scale); break;
      case 64: prefill_attention_impl<4, T>(query, key, value, out, scale); break;
      default: prefill_attention_impl<8, T>(query, key, value, out, scale); break;
    }
  };
  if (query.scalar_type() == at::kBFloat16) run(c10::BFloat16());
  else run(float());
#endif
}

}  // namespace kvik
