"""Write small llama GGUF files the way llama.cpp's converter lays them out, with the `gguf` package's
writer: metadata under llama.cpp's key names, a byte-level BPE tokenizer with a ChatML template, q/k
rows permuted (llama.cpp's `LlamaModel.permute`, written out here from its definition), and each 2-D
weight stored in a chosen GGML type.

`gguf` quantizes F16/BF16/Q8_0/Q4_0/Q4_1 itself; it has no quantizer for the K-quants, so Q4_K and
Q6_K tensors are random blocks with bounded scales. Either way the reference weights are whatever
the file holds, as read by `gguf.dequantize` or transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGUF_TINY_VOCAB = 512


@dataclass(frozen=True)
class LlamaShape:
    hidden: int = 256  # a multiple of 256, the K-quant block size
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    context: int = 1024
    std: float = 0.08


def hf_weight_shapes(shape: LlamaShape, vocab: int, tied: bool) -> dict[str, tuple[int, ...]]:
    head_dim = shape.hidden // shape.heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, shape.hidden),
                                          "model.norm.weight": (shape.hidden,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, shape.hidden)
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": (shape.hidden,),
            f"{p}.post_attention_layernorm.weight": (shape.hidden,),
            f"{p}.self_attn.q_proj.weight": (shape.heads * head_dim, shape.hidden),
            f"{p}.self_attn.k_proj.weight": (shape.kv_heads * head_dim, shape.hidden),
            f"{p}.self_attn.v_proj.weight": (shape.kv_heads * head_dim, shape.hidden),
            f"{p}.self_attn.o_proj.weight": (shape.hidden, shape.heads * head_dim),
            f"{p}.mlp.gate_proj.weight": (shape.intermediate, shape.hidden),
            f"{p}.mlp.up_proj.weight": (shape.intermediate, shape.hidden),
            f"{p}.mlp.down_proj.weight": (shape.hidden, shape.intermediate),
        })
    return shapes


GGUF_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    module = hf_name.removesuffix(".weight")
    if module.startswith("model.layers."):
        _, _, layer, rest = module.split(".", 3)
        return f"blk.{layer}.{GGUF_NAMES[rest]}.weight"
    return f"{GGUF_NAMES[module]}.weight"


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's permutation: per head, interleave the two rotary halves."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def random_k_quant_blocks(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K / Q6_K blocks whose values stay around +-0.1."""
    import gguf

    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q4_K:
        # d, dmin (fp16) lead each block; 6-bit scales/mins, 4-bit codes: w = d*s*q - dmin*m.
        d = rng.uniform(1e-4, 3e-4, size=(rows, cols // block_elems)).astype(np.float16)
        blocks[..., 0:2] = d[..., None].view(np.uint8)
        blocks[..., 2:4] = (d * np.float16(7.5))[..., None].view(np.uint8)
    elif qtype == gguf.GGMLQuantizationType.Q6_K:
        # d (fp16) ends each block; 8-bit signed scales, 6-bit codes: w = d*s*(q-32).
        d = rng.uniform(1e-5, 3e-5, size=(rows, cols // block_elems)).astype(np.float16)
        blocks[..., -2:] = d[..., None].view(np.uint8)
    else:
        raise ValueError(f"no random block recipe for {qtype}")
    return blocks.reshape(rows, -1)


def write_llama_gguf(path: Path, weight_type, *, shape: LlamaShape = LlamaShape(), tied: bool = True,
                     seed: int = 0, types: dict[str, object] | None = None) -> Path:
    """A random llama as a GGUF file; 2-D weights in `weight_type` unless `types` (GGUF tensor name
    suffix such as 'attn_q.weight' -> type) says otherwise; norms are F32 as llama.cpp writes them."""
    import gguf

    from kvik.core.tokenizer_files import CHAT_TEMPLATE, train_tokenizer

    tokenizer = train_tokenizer(GGUF_TINY_VOCAB)
    vocab = tokenizer.get_vocab()
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = [" ".join(pair) if isinstance(pair, list) else pair
              for pair in json.loads(tokenizer.to_str())["model"]["merges"]]
    special = {tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("kvik test llama")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.token_to_id("<|endoftext|>"))
    writer.add_eos_token_id(tokenizer.token_to_id("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(seed)
    for hf_name, dims in hf_weight_shapes(shape, len(tokens), tied).items():
        name = gguf_name(hf_name)
        if len(dims) == 1:
            writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(dims)).astype(np.float32))
            continue
        qtype = next((t for suffix, t in (types or {}).items() if name.endswith(suffix)), weight_type)
        if qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K):
            writer.add_tensor(name, random_k_quant_blocks(*dims, qtype, rng), raw_dtype=qtype)
            continue
        values = (shape.std * rng.standard_normal(dims)).astype(np.float32)
        if name.endswith("attn_q.weight"):
            values = llama_cpp_permute(values, shape.heads)
        elif name.endswith("attn_k.weight"):
            values = llama_cpp_permute(values, shape.kv_heads)
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, values)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
