// Every decoder layer of a Llama-family model for a step of 1-4 decodes, in one call from Python.
//
// At these batch sizes a step is bound by streaming the weights, and what is not streaming is
// overhead: run as nn.Modules, each layer spends about 60 us in Python between its kernels (module
// calls, views, splits, allocations), 0.7 ms of a 12 ms step for the 125M reference model. This
// chains the same kernels the modules call (kernels.h), in the same order and with the same
// arithmetic, so its outputs match the module path exactly; the modules remain the path for prefill,
// larger batches and every model this does not describe (Qwen3's q/k norm, GPT-2).
//
// Per layer: [residual +=] x; x = rms_norm(residual) -> qkv GEMV -> rotary on q, k -> k, v into the
// paged cache -> decode attention -> o GEMV -> residual += o; o = rms_norm(residual) -> gate_up
// GEMV -> silu(gate) * up -> down GEMV.
#include <torch/extension.h>

#include <cstring>
#include <vector>

#include "kernels.h"

namespace {

struct Packed {  // a OneDNNLinear's packed weight, as kvik::gemv_packed reads it
  int64_t address, out_features, in_stride, block;
  c10::optional<torch::Tensor> bias;

  torch::Tensor operator()(const torch::Tensor& x) const {
    return kvik::gemv_packed(x, address, out_features, in_stride, block, bias);
  }
};

struct Layer {
  torch::Tensor input_norm, post_norm;
  Packed qkv, o, gate_up, down;
  torch::Tensor key_cache, value_cache;  // (kv_heads, blocks, block_size, head_dim) each
};

Packed make_packed(const pybind11::tuple& spec) {
  TORCH_CHECK(spec.size() == 5, "packed weight: (address, out_features, in_stride, block, bias)");
  Packed packed{spec[0].cast<int64_t>(), spec[1].cast<int64_t>(), spec[2].cast<int64_t>(),
                spec[3].cast<int64_t>(), c10::nullopt};
  if (!spec[4].is_none()) packed.bias = spec[4].cast<torch::Tensor>();
  return packed;
}

class DecodeStack {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps,
              double scale)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), intermediate_(intermediate),
        eps_(eps), scale_(scale) {}

  void add_layer(const torch::Tensor& input_norm, const torch::Tensor& post_norm,
                 const pybind11::tuple& qkv, const pybind11::tuple& o, const pybind11::tuple& gate_up,
                 const pybind11::tuple& down, const torch::Tensor& kv_cache) {
    TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.size(1) == kv_heads_ &&
                    kv_cache.size(4) == head_dim_ && kv_cache.is_contiguous(),
                "kv_cache must be a contiguous (2, kv_heads, blocks, block_size, head_dim) tensor");
    layers_.push_back(Layer{input_norm, post_norm, make_packed(qkv), make_packed(o), make_packed(gate_up),
                            make_packed(down), kv_cache[0], kv_cache[1]});
  }

  // x: (T, hidden) embeddings of T decode tokens; cos, sin: (T, head_dim); slots: (T,) cache slots;
  // block_tables (T, width), seq_lens (T,) as for decode_attention. Returns (x, residual): the last
  // layer's output and the stream before it, for the final norm to add and normalise.
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& embeddings, const torch::Tensor& cos,
                                                   const torch::Tensor& sin, const torch::Tensor& slots,
                                                   const torch::Tensor& block_tables,
                                                   const torch::Tensor& seq_lens) const {
    TORCH_CHECK(embeddings.dim() == 2 && embeddings.is_contiguous(), "embeddings must be (T, hidden)");
    TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous(), "slots must be int64");
    const int64_t tokens = embeddings.size(0);
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    const int64_t* slot = slots.data_ptr<int64_t>();
    torch::Tensor residual = embeddings.clone();
    torch::Tensor x = torch::empty_like(embeddings);
    torch::Tensor attended = torch::empty({tokens, heads_, head_dim_}, embeddings.options());
    torch::Tensor activated = torch::empty({tokens, intermediate_}, embeddings.options());
    bool first = true;
    for (const Layer& layer : layers_) {
      if (first) {
        kvik::rms_norm(x, residual, layer.input_norm, eps_);
        first = false;
      } else {
        kvik::fused_add_rms_norm(x, residual, layer.input_norm, eps_);
      }
      torch::Tensor qkv = layer.qkv(x);  // (T, q + 2 kv)
      torch::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({tokens, heads_ + kv_heads_, head_dim_});
      kvik::rotary_inplace(qk, cos, sin);
      write_cache(qkv, q_size, layer.key_cache, slot, tokens);
      write_cache(qkv, q_size + kv_size, layer.value_cache, slot, tokens);
      torch::Tensor query = qkv.narrow(1, 0, q_size).contiguous().view({tokens, heads_, head_dim_});
      kvik::decode_attention(query, layer.key_cache, layer.value_cache, block_tables, seq_lens, scale_,
                             attended);
      torch::Tensor o = layer.o(attended.view({tokens, q_size}));
      kvik::fused_add_rms_norm(o, residual, layer.post_norm, eps_);
      torch::Tensor gate_up = layer.gate_up(o);
      kvik::silu_and_mul(activated, gate_up);
      x = layer.down(activated);
    }
    return {x, residual};
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  // Copy each token's kv heads (columns [offset, offset + kv_size) of qkv) into its cache slot of
  // every head: cache is (kv_heads, blocks * block_size, head_dim) once flattened.
  void write_cache(const torch::Tensor& qkv, int64_t offset, const torch::Tensor& cache, const int64_t* slot,
                   int64_t tokens) const {
    const int64_t slots_per_head = cache.size(1) * cache.size(2);
    const float* src = qkv.data_ptr<float>();
    float* dst = cache.data_ptr<float>();
    const size_t bytes = head_dim_ * sizeof(float);
    for (int64_t t = 0; t < tokens; ++t) {
      TORCH_CHECK(slot[t] >= 0 && slot[t] < slots_per_head, "cache slot out of range");
      const float* row = src + t * qkv.stride(0) + offset;
      for (int64_t h = 0; h < kv_heads_; ++h)
        std::memcpy(dst + (h * slots_per_head + slot[t]) * head_dim_, row + h * head_dim_, bytes);
    }
  }

  int64_t heads_, kv_heads_, head_dim_, intermediate_;
  double eps_, scale_;
  std::vector<Layer> layers_;
};

}  // namespace

void register_decode_stack(pybind11::module& m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, double, double>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("forward", &DecodeStack::forward)
      .def_property_readonly("num_layers", &DecodeStack::num_layers);
}
