// kvik's CPU kernels (float32 activations), callable from each other's translation units: the decode
// stack (decode_stack_cpu.cpp) chains them without returning to Python between layers.
//
// Only ATen's core headers here: the kernel files that need nothing more compile in a fraction of
// the time torch/extension.h takes; the files that register Python bindings include that themselves.
#pragma once

#include <tuple>

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>

namespace kvik {

// fused_ops_cpu.cpp
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
void rotary_inplace(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin);
// rotary_inplace's arithmetic on raw rows [begin, end) of `heads` heads of `dim` floats each, without
// tensor views (the decode stack calls it on the qkv projection's output directly).
void rotary_rows(float* base, int64_t begin, int64_t end, int64_t heads, int64_t dim, int64_t row_stride,
                 int64_t head_stride, const float* cos, const float* sin);
void silu_and_mul(at::Tensor& out, const at::Tensor& gate_up);
// (rows,) int64: what values.argmax(dim=-1) returns for a contiguous float32 (rows, n) tensor.
at::Tensor argmax_rows(const at::Tensor& values);

// paged_attention_cpu.cpp. The caches are (kv_heads, blocks, block_size, head_dim) in float32,
// bfloat16 or int8; int8 caches carry float16 scales (kv_heads, blocks, block_size), one per token
// and head: value = int8 * scale.
void decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                      at::Tensor& out, const c10::optional<at::Tensor>& key_scales = c10::nullopt,
                      const c10::optional<at::Tensor>& value_scales = c10::nullopt);
// set_plain_attention(true) runs decode_attention's plain loops where its AVX-512 passes would run
// (tests compare both; A/B timing).
void set_plain_attention(bool plain);
// Store rows of `source` (tokens, kv_heads, head_dim; last dimension contiguous) into their cache
// slots, converting to the cache's dtype (int8: symmetric per token and head, scale = amax / 127).
void write_kv(const at::Tensor& source, at::Tensor& cache, const c10::optional<at::Tensor>& scales,
              const at::Tensor& slots);
// write_kv on raw pointers (the decode stack's path, no tensor views per layer): `tokens` rows of
// kv_heads heads from src (token_stride, head_stride apart, dim floats each) into a (kv_heads,
// head_slots, dim) cache of `dtype`, at slots[t]; scale_out: the int8 cache's (kv_heads, head_slots)
// scales, else null. Checks each slot.
void write_kv_rows(const float* src, int64_t tokens, int64_t token_stride, int64_t head_stride, void* cache,
                   at::ScalarType dtype, int64_t kv_heads, int64_t head_slots, int64_t dim, c10::Half* scale_out,
                   const int64_t* slots);

// prefill_attention_cpu.cpp: causal attention of a prompt chunk's n query tokens (n, H, D) over
// L >= n keys and values (L, Hkv, D) (L - n of context, then the chunk's own) into out (n, H, D);
// float32 or bfloat16 (one dtype for all four), last dimension contiguous. Needs AVX-512 and
// head_dim 16/32/64/128 (prefill_attention_supported).
bool prefill_attention_supported(int64_t head_dim);
void prefill_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, at::Tensor& out,
                       double scale);

// gemv_cpu.cpp
at::Tensor gemv_packed(const at::Tensor& x, int64_t weight_address, int64_t out_features,
                       int64_t in_stride, int64_t block, const c10::optional<at::Tensor>& bias);
// The same into `out` (rows, out_features), unchecked: the decode stack's path.
void gemv_packed_into(const float* x, int64_t rows, int64_t in_features, int64_t weight_address,
                      int64_t out_features, int64_t in_stride, int64_t block, const float* bias, float* out);
// One block of `block` outputs of the packed weight for 1-4 rows of x, as gemv_packed's pass over
// those rows computes it (the same arithmetic, so the same bits; no bias), into out (rows, block).
void gemv_packed_block(const float* x, int64_t rows, int64_t in_features, int64_t weight_address, int64_t in_stride,
                       int64_t block, int64_t index, float* out);
// The packed weight's values as a dense (out_features, in_features) float32 tensor.
at::Tensor unpack_packed_float32(int64_t weight_address, int64_t out_features, int64_t in_features,
                                 int64_t in_stride, int64_t block);

// How a linear layer's weight is held. kPackedFloat32 is oneDNN's prepacked buffer (gemv_cpu.cpp);
// the weight-only formats use kvik's blocked layout (weight_only_cpu.cpp): blocks of kWeightBlock
// output rows, each stored input-major so one load covers the block's outputs for one input element.
enum WeightFormat : int64_t { kPackedFloat32 = 0, kBFloat16 = 1, kInt8 = 2, kInt4 = 3 };
constexpr int64_t kWeightBlock = 16;
// How far ahead in a block's weight stream the decode kernels ask for lines (prefetcht2): the
// hardware prefetcher stops at page boundaries. 1 KiB left a one-row decode waiting on the cache:
// 4 KiB ran 48 layers of 768 x 2048 at one row 1.45x faster in bfloat16, 1.25x in int8 and 1.37x
// in int4, and the 125M reference model's single-stream decode 1.3-1.4x (bfloat16), 1.1-1.3x
// (int8), 1.1-1.2x (int4) and ~1.05x (float32, oneDNN-packed), alternating builds on the 2-core
// AVX-512 machine; 8 and 16 KiB were slower than 4 again. That was one machine, on 4 KiB pages:
// on another (AMD Zen 4, weights on 2 MiB pages) 4 KiB ran the same kernels at 0.7x of 1 KiB or
// none, so the weight-only kernels take their distance from weight_prefetch_bytes(), which kvik
// measures per process (kvik.model.transforms.prefetch); this constant stays the packed float32
// GEMV's distance, the streaming read's, and the weight-only kernels' until something sets theirs.
constexpr int kWeightPrefetchBytes = 4096;
int64_t weight_prefetch_bytes();
void set_weight_prefetch_bytes(int64_t bytes);  // 0: no software prefetch

struct LinearWeight {
  int64_t format = kPackedFloat32;
  int64_t out_features = 0, in_features = 0;
  // kPackedFloat32: oneDNN's buffer address (kept alive by the Python module), its block and stride.
  int64_t address = 0, in_stride = 0, block = 0;
  // Weight-only formats: data (blocks, in_features, 16) bf16 / int8 or (blocks, in_features, 8) uint8
  // for int4; scales (blocks * 16,) float32 for int8 per row, (blocks, groups, 16) float16 for int4
  // and for int8 with a group size;
  // offsets like scales for int4 with zero points (value = nibble * scale + offset), else undefined
  // (value = (nibble - 8) * scale).
  at::Tensor data, scales, offsets;
  int64_t group = 0;  // int4, int8 with groups: input elements per scale (int8 per row: 0)
  // int8 / int4: may multiply int8-rounded activations where the CPU has AVX512-VNNI (the engine's
  // --activations; set_int8_activations(false) turns it off for every weight).
  bool allow_int8_activations = true;
  // Batches of 12+ rows on a bfloat16 weight may round their rows to bfloat16 and multiply in the
  // AVX512-BF16 tiles (set where the CPU multiplies bfloat16 natively; off: float32 activations).
  bool allow_bf16_activations = false;
  c10::optional<at::Tensor> bias;

  // y = x W^T + b for a float32 (rows, in_features) x. Weight-only formats dequantize in registers
  // and stream each block of weights once for up to four rows, from cache for more (on AVX-512 from
  // 16 rows: a pair of blocks widened once per chunk of rows, tiles of 12 rows).
  at::Tensor operator()(const at::Tensor& x) const;
  // The same into a preallocated out (rows, out_features); the weight's own checks are left to
  // construction (weight_only() checks it; the decode stack calls this four times a layer, and the
  // checks and the allocation were ~1 us of each call).
  void forward_into(const at::Tensor& x, at::Tensor& out) const;
};

// read_bandwidth_cpu.cpp: streams the buffer the way the decode kernels stream weights and returns
// the sum of its 32-bit words mod 2^32 (so the reads cannot be dropped): the benchmarks' roofline.
int64_t stream_read(const at::Tensor& buffer);

// weight_only_cpu.cpp
void check_linear_weight(const LinearWeight& weight);  // throws unless shapes and dtypes agree
at::Tensor weight_only_linear(const at::Tensor& x, const LinearWeight& weight);
// Unchecked: rows of x (in_features floats each) into out (rows, out_features); the weight and its
// bias already checked (check_linear_weight, check_linear_bias).
void weight_only_linear_into(const float* x, int64_t rows, const LinearWeight& weight, float* out);
void check_linear_bias(const LinearWeight& weight);
// The dense weight, transposed: (in_features, out_features) float32 or bfloat16, for prefill GEMMs.
at::Tensor dequantize_transposed(const LinearWeight& weight, bool bfloat16);
// The vector instructions the weight-only kernels use: "avx2", or "portable" (plain loops, compiled
// for whatever -march=native offers); set_portable_kernels(true) forces the plain loops (tests).
const char* simd_isa();
void set_portable_kernels(bool portable);
// On CPUs with AVX512-VNNI and AVX512-VBMI, int8 and int4 weights multiply activations rounded to
// int8 (per row and block of 32 inputs) in integer arithmetic; set_int8_activations(false) keeps them
// float32 (the AVX2 kernels). uses_int8_activations says which one a weight gets.
void set_int8_activations(bool enabled);
bool uses_int8_activations(const LinearWeight& weight);
// Whether prompts (16+ rows) on this weight run in kvik's kernel rather than a GEMM on the widened
// matrix: float32 activations on AVX-512 (register tiles of up to 12 rows by 32 outputs).
bool uses_prompt_tiles(const LinearWeight& weight);
// Whether batches of 12+ rows on this bfloat16 weight multiply in bfloat16 (AVX512-BF16).
bool uses_bf16_prompt_tiles(const LinearWeight& weight);
// Each row's argmax of x W^T for a packed float32 or bfloat16 `exact` W (no bias), the index the full
// product and argmax_rows give, bit for bit, from fewer bytes: `coarse` is W rounded to int8 (no
// bias) and bound a float32 (2, out_features) such that the coarse and exact logits of output j
// differ by at most bound[0][j] * sum(|x|) + bound[1][j] * (the activations' int8 steps, where the
// copy takes int8 activations) for any x (weight_only_cpu.cpp says why). Returns the indices and
// how many blocks of 16 outputs it computed exactly, each for a pass of up to four rows (-1 where
// it computed the full product instead: non-finite values, or rows the full product would run
// differently).
std::tuple<at::Tensor, int64_t> screened_argmax(const at::Tensor& x, const LinearWeight& exact,
                                                const LinearWeight& coarse, const at::Tensor& bound);

}  // namespace kvik
