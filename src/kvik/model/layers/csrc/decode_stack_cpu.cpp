// Every decoder layer of a Llama-family model for a step of 1-8 decodes (GEMV_MAX_ROWS), in one call
// from Python, and the Python bindings of all of kvik's CPU kernels.
//
// At these batch sizes a step is bound by streaming the weights, and what is not streaming is
// overhead: run as nn.Modules, each layer spends about 60 us in Python between its kernels (module
// calls, views, splits, allocations), 0.7 ms of a 12 ms step for the 125M reference model. This
// chains the same kernels the modules call (kernels.h), in the same order and with the same
// arithmetic, so its outputs match the module path exactly; the modules remain the path for prefill,
// larger batches and every model this does not describe (Qwen3's q/k norm, GPT-2). Weights may be
// oneDNN-packed float32 or any weight-only format (LinearWeight), the KV cache float32, bfloat16 or
// int8.
//
// Per layer: [residual +=] x; x = rms_norm(residual) -> qkv GEMV -> rotary on q, k -> k, v into the
// paged cache -> decode attention -> o GEMV -> residual += o; o = rms_norm(residual) -> gate_up
// GEMV -> silu(gate) * up -> down GEMV.
//
// The step's parallel kernels (the GEMVs, attention) run on one team of threads held for the step
// (decode_team.h) rather than an OpenMP region each; the projections write into buffers allocated
// once per step.
#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <memory>
#include <thread>
#include <tuple>
#include <vector>

#include "decode_team.h"
#include "kernels.h"

namespace {

using WeightPtr = std::shared_ptr<kvik::LinearWeight>;

// set_decode_team(false): every kernel of a step opens its own OpenMP region (tests, A/B timing).
std::atomic<bool> use_team{true};

struct Layer {
  torch::Tensor input_norm, post_norm;
  WeightPtr qkv, o, gate_up, down;
  torch::Tensor key_cache, value_cache;  // (kv_heads, blocks, block_size, head_dim) each
  c10::optional<torch::Tensor> key_scales, value_scales;  // (kv_heads, blocks, block_size), int8 only
  c10::Half* key_scale_rows = nullptr;  // their data, for write_kv_rows
  c10::Half* value_scale_rows = nullptr;
};

class DecodeStack {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps,
              double scale)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), intermediate_(intermediate),
        eps_(eps), scale_(scale) {}

  // kv_cache: (2, kv_heads, blocks, block_size, head_dim); kv_scales: (2, kv_heads, blocks,
  // block_size) float16 for an int8 cache, else None.
  void add_layer(const torch::Tensor& input_norm, const torch::Tensor& post_norm, const WeightPtr& qkv,
                 const WeightPtr& o, const WeightPtr& gate_up, const WeightPtr& down,
                 const torch::Tensor& kv_cache, const c10::optional<torch::Tensor>& kv_scales) {
    TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.size(1) == kv_heads_ &&
                    kv_cache.size(4) == head_dim_ && kv_cache.is_contiguous(),
                "kv_cache must be a contiguous (2, kv_heads, blocks, block_size, head_dim) tensor");
    Layer layer{input_norm, post_norm, qkv, o, gate_up, down, kv_cache[0], kv_cache[1], c10::nullopt,
                c10::nullopt};
    if (kv_scales.has_value()) {
      TORCH_CHECK(kv_scales->dim() == 4 && kv_scales->size(0) == 2 && kv_scales->is_contiguous(),
                  "kv_scales must be a contiguous (2, kv_heads, blocks, block_size) tensor");
      TORCH_CHECK(kv_scales->scalar_type() == torch::kHalf && kv_scales->size(1) == kv_heads_ &&
                      kv_scales->size(2) == kv_cache.size(2) && kv_scales->size(3) == kv_cache.size(3),
                  "kv_scales must be float16, one per cached token and head");
      layer.key_scales = (*kv_scales)[0];
      layer.value_scales = (*kv_scales)[1];
      layer.key_scale_rows = layer.key_scales->data_ptr<c10::Half>();
      layer.value_scale_rows = layer.value_scales->data_ptr<c10::Half>();
    } else {
      TORCH_CHECK(kv_cache.scalar_type() != torch::kChar, "an int8 kv_cache needs kv_scales");
    }
    TORCH_CHECK(layers_.empty() || (kv_cache.size(2) * kv_cache.size(3) == head_slots_),
                "every layer's cache must have the same blocks and block size");
    head_slots_ = kv_cache.size(2) * kv_cache.size(3);
    layers_.push_back(std::move(layer));
  }

  // x: (T, hidden) embeddings of T decode tokens; cos, sin: (T, head_dim); slots: (T,) cache slots;
  // block_tables (T, width), seq_lens (T,) as for decode_attention. Returns (x, residual): the last
  // layer's output and the stream before it, for the final norm to add and normalise.
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& embeddings, const torch::Tensor& cos,
                                                   const torch::Tensor& sin, const torch::Tensor& slots,
                                                   const torch::Tensor& block_tables,
                                                   const torch::Tensor& seq_lens) const {
    return on_team([&] { return run_layers(embeddings, cos, sin, slots, block_tables, seq_lens); });
  }

  // The whole decode body from token ids: the embedding rows and the rotary tables' rows looked up
  // here, the final norm applied; returns the normalised hidden states (T, hidden). The same
  // operations LlamaModel runs around the layers (embedding lookup, cos[positions], the final
  // fused add + norm), without a Python call for each (embedding: (vocab, hidden) float32; cos, sin:
  // (max_positions, head_dim)).
  torch::Tensor forward_tokens(const torch::Tensor& input_ids, const torch::Tensor& positions,
                               const torch::Tensor& embedding, const torch::Tensor& cos_table,
                               const torch::Tensor& sin_table, const torch::Tensor& final_norm, double final_eps,
                               const torch::Tensor& slots, const torch::Tensor& block_tables,
                               const torch::Tensor& seq_lens) const {
    TORCH_CHECK(embedding.scalar_type() == torch::kFloat, "the embedding must be float32");
    torch::Tensor x = embedding.index_select(0, input_ids);
    auto [hidden, residual] = forward(x, cos_table.index_select(0, positions), sin_table.index_select(0, positions),
                                      slots, block_tables, seq_lens);
    kvik::fused_add_rms_norm(hidden, residual, final_norm, final_eps);
    return hidden;
  }

  // Forwards 2..n of a multi-step run (kvik.engine.multi_step) whose rows all decode greedily
  // (no logprobs, no logit processors), in one call: each forward is forward_tokens', then the LM
  // head and the argmax as LlamaForCausalLM.compute_logits and the sampler run them (the same
  // kernels, so the same tokens), and feeds its tokens to the next. In Python each of these
  // forwards paid ~0.1 ms between its kernels (metadata tensors, module calls, the sampler), 7 %
  // of an int4 step of the 125M reference model; here one team of threads also serves them all.
  //
  // token_ids (T,): the tokens the forward before chose, at start_positions (T,); block_tables
  // (T, width) every block of each row's run (allocated up front); stop_ids (T, S) each row's stop
  // tokens, -1 padding; live (T,) bool: false for a row that has stopped already. Runs `steps`
  // forwards, or fewer once every row has chosen one of its stop tokens (or was not live); returns
  // the tokens, (forwards run, T).
  torch::Tensor greedy_steps(const torch::Tensor& token_ids, const torch::Tensor& start_positions,
                             const torch::Tensor& block_tables, int64_t block_size, int64_t steps,
                             const torch::Tensor& stop_ids, const torch::Tensor& live, const torch::Tensor& embedding,
                             const torch::Tensor& cos_table, const torch::Tensor& sin_table,
                             const torch::Tensor& final_norm, double final_eps, const WeightPtr& head,
                             const WeightPtr& coarse_head, const c10::optional<torch::Tensor>& head_bound) const {
    const int64_t rows = token_ids.numel();
    TORCH_CHECK(token_ids.scalar_type() == torch::kInt64 && start_positions.scalar_type() == torch::kInt64 &&
                    start_positions.numel() == rows && token_ids.dim() == 1 && start_positions.dim() == 1 &&
                    start_positions.is_contiguous(),
                "token_ids and start_positions must be int64 (T,)");
    TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == rows && block_tables.is_contiguous() &&
                    block_tables.scalar_type() == torch::kInt64,
                "block_tables must be a contiguous int64 (T, width) tensor");
    TORCH_CHECK(stop_ids.dim() == 2 && stop_ids.size(0) == rows && stop_ids.is_contiguous() &&
                    stop_ids.scalar_type() == torch::kInt64,
                "stop_ids must be a contiguous int64 (T, S) tensor");
    TORCH_CHECK(live.scalar_type() == torch::kBool && live.numel() == rows && live.is_contiguous(),
                "live must be a contiguous bool (T,) tensor");
    TORCH_CHECK(block_size > 0 && steps >= 0 && head && head->in_features == final_norm.numel(),
                "a positive block size, steps >= 0 and an LM head over the hidden size");
    TORCH_CHECK(!coarse_head == !head_bound.has_value(), "a coarse head comes with its bound");
    const int64_t width = block_tables.size(1), stops = stop_ids.size(1);
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    const int64_t* stop = stop_ids.data_ptr<int64_t>();
    const int64_t* start = start_positions.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r)
      TORCH_CHECK(start[r] >= 0 && (steps == 0 || (start[r] + steps - 1) / block_size < width),
                  "the block table does not cover the run");
    torch::Tensor out = torch::empty({steps, rows}, token_ids.options());
    if (steps == 0 || rows == 0) return out;
    int64_t ran = 0;
    on_team([&] {
      torch::Tensor ids = token_ids.contiguous().clone();
      // positions, slots, seq_lens of the forward at hand, in one buffer as the runner makes them
      torch::Tensor meta = torch::empty({3, rows}, token_ids.options());
      int64_t* values = meta.data_ptr<int64_t>();
      std::vector<char> stopped(rows, 0);
      const bool* alive = live.data_ptr<bool>();
      for (int64_t r = 0; r < rows; ++r) stopped[r] = !alive[r];
      for (int64_t s = 0; s < steps; ++s) {
        int64_t longest = 0;
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t position = start[r] + s;
          values[r] = position;
          values[rows + r] = tables[r * width + position / block_size] * block_size + position % block_size;
          values[2 * rows + r] = position + 1;
          longest = std::max(longest, position + 1);
        }
        // Only the blocks that hold tokens so far, as the runner passes them.
        const int64_t used = (longest + block_size - 1) / block_size;
        torch::Tensor table = used == width ? block_tables : block_tables.narrow(1, 0, used).contiguous();
        torch::Tensor hidden = forward_tokens(ids, meta[0], embedding, cos_table, sin_table, final_norm, final_eps,
                                              meta[1], table, meta[2]);
        torch::Tensor chosen = coarse_head ? std::get<0>(kvik::screened_argmax(hidden, *head, *coarse_head, *head_bound))
                                           : kvik::argmax_rows((*head)(hidden));
        const int64_t* tokens = chosen.data_ptr<int64_t>();
        int64_t* next = ids.data_ptr<int64_t>();
        int64_t* row_out = out.data_ptr<int64_t>() + s * rows;
        bool all_stopped = true;
        for (int64_t r = 0; r < rows; ++r) {
          next[r] = row_out[r] = tokens[r];
          for (int64_t j = 0; j < stops && !stopped[r]; ++j) stopped[r] = stop[r * stops + j] == tokens[r];
          all_stopped = all_stopped && stopped[r];
        }
        ran = s + 1;
        if (all_stopped) break;
      }
      return 0;
    });
    return out.narrow(0, 0, ran);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  // body() with the step's parallel kernels on one team of threads (decode_team.h): this thread
  // runs body, the others serve the kernels' chunks until it is done, whether it returns or throws.
  // Inside a team already (greedy_steps' forwards), or where a team cannot be had, body() as is.
  template <typename Body>
  auto on_team(const Body& body) const -> decltype(body()) {
    const int threads = at::get_num_threads();
    if (!use_team.load(std::memory_order_relaxed) || threads <= 1 || kvik::current_team != nullptr ||
        at::in_parallel_region() || threads > static_cast<int>(std::thread::hardware_concurrency()))
      return body();
    decltype(body()) result;
    std::exception_ptr error;
    kvik::DecodeTeam team(threads);
#pragma omp parallel num_threads(threads)
    {
      if (omp_get_thread_num() == 0) {
        // Given fewer threads than asked, no team (a job would wait for a thread that is not
        // there): the kernels run on this thread alone.
        if (omp_get_num_threads() == threads) kvik::current_team = &team;
        try {
          result = body();
        } catch (...) {
          error = std::current_exception();
        }
        kvik::current_team = nullptr;
        team.stop();
      } else {
        team.serve(omp_get_thread_num());
      }
    }
    if (error) std::rethrow_exception(error);
    return result;
  }

  std::tuple<torch::Tensor, torch::Tensor> run_layers(const torch::Tensor& embeddings, const torch::Tensor& cos,
                                                      const torch::Tensor& sin, const torch::Tensor& slots,
                                                      const torch::Tensor& block_tables,
                                                      const torch::Tensor& seq_lens) const {
    TORCH_CHECK(embeddings.dim() == 2 && embeddings.is_contiguous(), "embeddings must be (T, hidden)");
    TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous(), "slots must be int64");
    const int64_t tokens = embeddings.size(0);
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_, head_slots = head_slots_;
    const int64_t hidden = embeddings.size(1);
    torch::Tensor residual = embeddings.clone();
    torch::Tensor x = torch::empty_like(embeddings);
    // Each projection's output, written in place layer after layer (forward_into).
    torch::Tensor qkv = torch::empty({tokens, q_size + 2 * kv_size}, embeddings.options());
    torch::Tensor o = torch::empty({tokens, hidden}, embeddings.options());
    torch::Tensor gate_up = torch::empty({tokens, 2 * intermediate_}, embeddings.options());
    torch::Tensor attended = torch::empty({tokens, heads_, head_dim_}, embeddings.options());
    torch::Tensor activated = torch::empty({tokens, intermediate_}, embeddings.options());
    torch::Tensor query = torch::empty({tokens, heads_, head_dim_}, embeddings.options());
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == tokens &&
                    cos.size(1) == head_dim_ && sin.sizes() == cos.sizes() && cos.scalar_type() == torch::kFloat &&
                    sin.scalar_type() == torch::kFloat,
                "cos and sin must be contiguous float32 (T, head_dim)");
    TORCH_CHECK(slots.numel() == tokens, "one slot per token");
    const int64_t row_width = q_size + 2 * kv_size;
    const float* cos_rows = cos.data_ptr<float>();
    const float* sin_rows = sin.data_ptr<float>();
    const int64_t* slot_ids = slots.data_ptr<int64_t>();
    float* query_rows = query.data_ptr<float>();
    bool first = true;
    for (const Layer& layer : layers_) {
      if (first) {
        kvik::rms_norm(x, residual, layer.input_norm, eps_);
        first = false;
      } else {
        kvik::fused_add_rms_norm(x, residual, layer.input_norm, eps_);
      }
      layer.qkv->forward_into(x, qkv);  // (T, q + 2 kv)
      // Rotary on the q and k heads, k and v into the cache and q into `query`, on raw rows: as
      // tensor views (narrow, view, contiguous) these cost 3-4 us a layer, 4 % of a step of a
      // 30-layer model.
      float* rows = qkv.data_ptr<float>();
      kvik::rotary_rows(rows, 0, tokens, heads_ + kv_heads_, head_dim_, row_width, head_dim_, cos_rows, sin_rows);
      kvik::write_kv_rows(rows + q_size, tokens, row_width, head_dim_, layer.key_cache.data_ptr(),
                          layer.key_cache.scalar_type(), kv_heads_, head_slots, head_dim_, layer.key_scale_rows,
                          slot_ids);
      kvik::write_kv_rows(rows + q_size + kv_size, tokens, row_width, head_dim_, layer.value_cache.data_ptr(),
                          layer.value_cache.scalar_type(), kv_heads_, head_slots, head_dim_,
                          layer.value_scale_rows, slot_ids);
      for (int64_t t = 0; t < tokens; ++t)
        std::memcpy(query_rows + t * q_size, rows + t * row_width, q_size * sizeof(float));
      kvik::decode_attention(query, layer.key_cache, layer.value_cache, block_tables, seq_lens, scale_,
                             attended, layer.key_scales, layer.value_scales);
      layer.o->forward_into(attended.view({tokens, q_size}), o);
      kvik::fused_add_rms_norm(o, residual, layer.post_norm, eps_);
      layer.gate_up->forward_into(o, gate_up);
      kvik::silu_and_mul(activated, gate_up);
      layer.down->forward_into(activated, x);
    }
    return {x, residual};
  }

  int64_t heads_, kv_heads_, head_dim_, intermediate_;
  int64_t head_slots_ = 0;  // blocks * block_size of each layer's cache
  double eps_, scale_;
  std::vector<Layer> layers_;
};

WeightPtr packed_float32(int64_t address, int64_t out_features, int64_t in_features, int64_t in_stride,
                         int64_t block, const c10::optional<torch::Tensor>& bias) {
  auto weight = std::make_shared<kvik::LinearWeight>();
  weight->format = kvik::kPackedFloat32;
  weight->address = address;
  weight->out_features = out_features;
  weight->in_features = in_features;
  weight->in_stride = in_stride;
  weight->block = block;
  weight->bias = bias;
  // Checked here once: the decode stack's calls (forward_into) do not check the weight again.
  TORCH_CHECK(block == 16 || block == 32 || block == 64, "unsupported block of ", block, " output rows");
  TORCH_CHECK(address != 0 && in_stride >= in_features && out_features > 0, "not a packed weight");
  kvik::check_linear_bias(*weight);
  return weight;
}

WeightPtr weight_only(int64_t format, const torch::Tensor& data, const c10::optional<torch::Tensor>& scales,
                      const c10::optional<torch::Tensor>& offsets, int64_t out_features, int64_t in_features,
                      int64_t group, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(format == kvik::kBFloat16 || format == kvik::kInt8 || format == kvik::kInt4,
              "format must be bfloat16 (1), int8 (2) or int4 (3)");
  auto weight = std::make_shared<kvik::LinearWeight>();
  weight->format = format;
  weight->data = data;
  if (scales.has_value()) weight->scales = *scales;
  if (offsets.has_value()) weight->offsets = *offsets;
  weight->out_features = out_features;
  weight->in_features = in_features;
  weight->group = group;
  weight->bias = bias;
  weight->block = kvik::kWeightBlock;
  kvik::check_linear_weight(*weight);  // shapes and dtypes now, not at the first forward
  kvik::check_linear_bias(*weight);
  return weight;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("decode_attention", &kvik::decode_attention,
        "paged decode attention over a float32, bfloat16 or int8 cache (CPU)", py::arg("query"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("out"), py::arg("key_scales") = py::none(),
        py::arg("value_scales") = py::none());
  m.def("prefill_attention", &kvik::prefill_attention,
        "causal attention of a prompt chunk: query (n, H, D), key and value (L, Hkv, D), out (n, H, D)",
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("out"), py::arg("scale"));
  m.def("prefill_attention_supported", &kvik::prefill_attention_supported,
        "whether prefill_attention runs here for this head_dim (AVX-512 builds)");
  m.def("set_decode_team", [](bool enabled) { use_team.store(enabled); },
        "run a decode step's kernels on one team of threads held for the step (the default) or each in "
        "its own OpenMP region (tests, A/B timing)");
  m.def("set_plain_attention", &kvik::set_plain_attention,
        "run decode_attention's plain loops even where its AVX-512 pass applies (for tests)");
  m.def("write_kv", &kvik::write_kv, "store (tokens, kv_heads, head_dim) rows into their cache slots");
  m.def("rms_norm", &kvik::rms_norm, "out = rms_norm(x) * weight");
  m.def("fused_add_rms_norm", &kvik::fused_add_rms_norm, "residual += x; x = rms_norm(residual) * weight");
  m.def("rotary_inplace", &kvik::rotary_inplace, "neox-style rotary embedding, in place");
  m.def("silu_and_mul", &kvik::silu_and_mul, "out = silu(gate) * up");
  m.def("argmax_rows", &kvik::argmax_rows, "values.argmax(dim=-1) for a contiguous float32 (rows, n) tensor");
  m.def("unpack_packed_float32", &kvik::unpack_packed_float32,
        "oneDNN's packed float32 weight as a dense (out_features, in_features) tensor",
        py::arg("address"), py::arg("out_features"), py::arg("in_features"), py::arg("in_stride"), py::arg("block"));
  m.def("screened_argmax", &kvik::screened_argmax,
        "argmax_rows(x W^T) for a packed float32 or bfloat16 W, from its int8 copy and a bound: (indices, "
        "blocks computed exactly, -1 where it computed the full product)",
        py::arg("x"), py::arg("exact"), py::arg("coarse"), py::arg("bound"));
  m.def("gemv_packed", &kvik::gemv_packed, "y = x W^T + b for rows of x (a few: it streams W once), W in oneDNN's packed layout");
  m.def("stream_read", &kvik::stream_read,
        "read a contiguous CPU tensor as the decode kernels read weights; the sum of its 32-bit words mod 2**32");
  m.def("simd_isa", &kvik::simd_isa, "the vector instructions the weight-only kernels use");
  m.def("set_portable_kernels", &kvik::set_portable_kernels,
        "run the weight-only kernels' plain loops even where AVX2 is available (for tests)");
  m.def("weight_prefetch_bytes", &kvik::weight_prefetch_bytes,
        "how far ahead (bytes) the weight-only kernels ask for the lines of a weight stream");
  m.def("set_weight_prefetch_bytes", &kvik::set_weight_prefetch_bytes,
        "set that distance for this process (0: no software prefetch; results do not depend on it)");
  m.def("set_int8_activations", &kvik::set_int8_activations,
        "round activations to int8 for int8/int4 weights where the CPU has AVX512-VNNI (the default)");

  py::class_<kvik::LinearWeight, WeightPtr>(m, "LinearWeight")
      .def_static("packed_float32", &packed_float32, "oneDNN's packed float32 weight",
                  py::arg("address"), py::arg("out_features"), py::arg("in_features"), py::arg("in_stride"),
                  py::arg("block"), py::arg("bias") = py::none())
      .def_static("weight_only", &weight_only, "a bfloat16 / int8 / int4 weight in kvik's blocked layout",
                  py::arg("format"), py::arg("data"), py::arg("scales") = py::none(),
                  py::arg("offsets") = py::none(), py::arg("out_features"), py::arg("in_features"),
                  py::arg("group") = 0, py::arg("bias") = py::none())
      .def("__call__", &kvik::LinearWeight::operator(), "y = x W^T + b for float32 (rows, in_features) x")
      .def("dequantize_transposed", [](const kvik::LinearWeight& w, bool bfloat16) {
             return kvik::dequantize_transposed(w, bfloat16);
           }, py::arg("bfloat16") = false)
      .def("int8_activations", &kvik::uses_int8_activations,
           "whether this weight multiplies int8-rounded activations (AVX512-VNNI)")
      .def("bf16_prompt_tiles", &kvik::uses_bf16_prompt_tiles,
           "whether batches of 12+ rows on this bfloat16 weight multiply in bfloat16 tiles (AVX512-BF16, allowed)")
      .def("prompt_tiles", &kvik::uses_prompt_tiles,
           "whether prompts (16+ rows) on this weight run in the kernel's AVX-512 tiles, not a GEMM")
      .def_readwrite("allow_bf16_activations", &kvik::LinearWeight::allow_bf16_activations,
                     "may batches of 12+ rows on this bfloat16 weight round their rows to bfloat16 for the "
                     "AVX512-BF16 tiles (default false)")
      .def_readwrite("allow_int8_activations", &kvik::LinearWeight::allow_int8_activations,
                     "may this weight use int8 activations (where the CPU can; default true)")
      .def_readonly("format", &kvik::LinearWeight::format)
      .def_readonly("out_features", &kvik::LinearWeight::out_features)
      .def_readonly("in_features", &kvik::LinearWeight::in_features);

  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, double>())
      .def("add_layer", &DecodeStack::add_layer, py::arg("input_norm"), py::arg("post_norm"), py::arg("qkv"),
           py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("kv_cache"),
           py::arg("kv_scales") = py::none())
      .def("forward", &DecodeStack::forward)
      .def("forward_tokens", &DecodeStack::forward_tokens, py::arg("input_ids"), py::arg("positions"),
           py::arg("embedding"), py::arg("cos"), py::arg("sin"), py::arg("final_norm"), py::arg("final_eps"),
           py::arg("slots"), py::arg("block_tables"), py::arg("seq_lens"))
      .def("greedy_steps", &DecodeStack::greedy_steps, py::arg("token_ids"), py::arg("start_positions"),
           py::arg("block_tables"), py::arg("block_size"), py::arg("steps"), py::arg("stop_ids"), py::arg("live"),
           py::arg("embedding"), py::arg("cos"), py::arg("sin"), py::arg("final_norm"), py::arg("final_eps"),
           py::arg("head"), py::arg("coarse_head") = py::none(), py::arg("head_bound") = py::none())
      .def_property_readonly("num_layers", &DecodeStack::num_layers);
}
