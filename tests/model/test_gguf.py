"""GGUF files: weights equal the `gguf` package's dequantization and transformers' GGUF reader, config
and tokenizer come from the metadata, and greedy output equals transformers loading the same file.
The 4-bit types (Q4_0/Q4_1/Q4_K) are served as int4 layers from their own blocks; the others, and
fused modules with a piece in another type, fall back to the same dequantization."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch

from kvik import LLM, SamplingParams
from kvik.core.errors import ConfigError
from kvik.core.tokenizer import Tokenizer
from kvik.model.loader import load_model, load_model_config, resolve_model_path
from kvik.model.quant import WeightOnlyLinear
from kvik.model.quant.packing import unpack_int4
from kvik.model.quant.reference import dequantize_int8, quantize_int8
from kvik.model.weights import FLOAT_PIECE
from tests.model.gguf_files import LlamaShape, write_llama_gguf

Q = gguf.GGMLQuantizationType
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K]
# The mix of a llama.cpp Q4_K_M file, plus the other types, in one model.
MIXED = {"token_embd.weight": Q.Q8_0, "attn_q.weight": Q.Q4_K, "attn_k.weight": Q.Q4_0,
         "attn_v.weight": Q.Q6_K, "attn_output.weight": Q.Q4_1, "ffn_gate.weight": Q.F16,
         "ffn_up.weight": Q.BF16, "ffn_down.weight": Q.Q6_K, "output.weight": Q.Q8_0}


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


def hf_from_gguf(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def kvik_weights(path) -> dict[str, torch.Tensor]:
    """kvik's loaded parameters under HF names (fused q/k/v and gate/up split back)."""
    config = load_model_config(path)
    model = load_model(path, config, torch.device("cpu"), torch.float32, show_progress=False).model
    q, kv, inter = config.num_heads * config.head_dim, config.kv_dim, config.intermediate_size
    weights = {}
    for name, param in model.state_dict().items():
        if "qkv_proj" in name:
            for part, rows in (("q_proj", slice(0, q)), ("k_proj", slice(q, q + kv)),
                               ("v_proj", slice(q + kv, q + 2 * kv))):
                weights[name.replace("qkv_proj", part)] = param[rows]
        elif "gate_up_proj" in name:
            weights[name.replace("gate_up_proj", "gate_proj")] = param[:inter]
            weights[name.replace("gate_up_proj", "up_proj")] = param[inter:]
        else:
            weights[name] = param
    return weights


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_weights_equal_gguf_dequantize_and_transformers(gguf_dir, qtype):
    path = write_llama_gguf(gguf_dir / f"{qtype.name}.gguf", qtype, tied=False, seed=1)
    ours = kvik_weights(path)
    reference = hf_from_gguf(path).state_dict()
    for name, expected in reference.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        torch.testing.assert_close(ours[name], expected, rtol=0, atol=0, msg=name)
    # Tensors stored without permutation equal the gguf package's own dequantization bit for bit.
    reader = gguf.GGUFReader(path)
    down = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    assert down.tensor_type == qtype
    expected = torch.from_numpy(np.array(gguf.dequantize(down.data, down.tensor_type)))
    assert torch.equal(ours["model.layers.1.mlp.down_proj.weight"], expected)


def test_config_comes_from_the_metadata(gguf_dir):
    shape = LlamaShape()
    tied = write_llama_gguf(gguf_dir / "tied.gguf", Q.F32, tied=True)
    config = load_model_config(resolve_model_path(str(tied)))
    assert (config.architecture, config.hidden_size, config.num_layers, config.num_heads,
            config.num_kv_heads, config.head_dim, config.intermediate_size) == (
        "LlamaForCausalLM", shape.hidden, shape.layers, shape.heads, shape.kv_heads,
        shape.hidden // shape.heads, shape.intermediate)
    assert config.tie_word_embeddings and config.max_position_embeddings == shape.context
    assert config.rope_theta == 10000.0 and config.vocab_size == 512
    untied = write_llama_gguf(gguf_dir / "untied.gguf", Q.F32, tied=False)
    assert not load_model_config(untied).tie_word_embeddings


def test_tokenizer_and_chat_template_equal_transformers_and_are_cached(gguf_dir, tmp_path,
                                                                      monkeypatch):
    import transformers

    monkeypatch.setenv("KVIK_CACHE_DIR", str(tmp_path))

    path = write_llama_gguf(gguf_dir / "tok.gguf", Q.F32)
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = Tokenizer.from_pretrained(str(path))
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name the moons of Mars, please!"}]
    text = ours.apply_chat_template(messages)
    assert text == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant\n" in text
    assert ours.encode(text) == reference.encode(text)
    assert ours.eos_token_id == reference.eos_token_id == reference.convert_tokens_to_ids("<|im_end|>")
    cached = list((tmp_path / "gguf-tokenizers").iterdir())
    assert len(cached) == 1 and cached[0].name.startswith("tok-")
    assert Tokenizer.from_pretrained(str(path)).encode(text) == reference.encode(text)  # from the cache


@torch.no_grad()
@pytest.mark.parametrize("weight_type,types", [(Q.Q8_0, MIXED), (Q.Q4_K, None), (Q.Q4_0, None)],
                         ids=["mixed", "Q4_K", "Q4_0"])
def test_greedy_output_equals_transformers_on_the_same_file(gguf_dir, weight_type, types, float_activations):
    """kvik serves the 4-bit tensors as int4 (all linears of the Q4_K and Q4_0 files, attn_output of
    the mixed one), transformers dequantizes them to float32."""
    path = write_llama_gguf(gguf_dir / f"greedy-{weight_type.name}.gguf", weight_type, tied=False, seed=3,
                            types=types)
    llm = LLM(str(path), show_progress=False)
    layers = "9 linear layers" if types is None else "2 linear layers, 2 dequantized"
    assert f"; {layers})" in llm.engine.info.precision
    hf = hf_from_gguf(path)
    prompts = ["The moon rose over the quiet hills", "Questions and answers", "Once upon a time"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for prompt in prompts:
        ids = llm.engine.tokenizer.encode(prompt)
        ours = llm.generate([ids], params)[0].outputs[0].token_ids
        out = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12,
                          do_sample=False, pad_token_id=0)
        assert ours == out[0, len(ids):].tolist(), prompt


@torch.no_grad()
def test_q8_0_files_are_served_as_int8_with_their_own_codes_and_scales(gguf_dir):
    """Q8_0 is int8 with a float16 scale per 32 inputs: kvik's int8 with groups of 32 holds it
    exactly (requantizing the file's weights gives them back bit for bit), so a Q8_0 file is served
    in it by default, at a quarter of float32's bytes, with the output of transformers' float32."""
    path = write_llama_gguf(gguf_dir / "served-Q8_0.gguf", Q.Q8_0, tied=False, seed=5)
    matrices = {n: w for n, w in kvik_weights(path).items() if w.dim() == 2 and "embed" not in n}
    assert len(matrices) == 7 * 2 + 1  # q, k, v, o, gate, up, down per layer; the LM head
    for name, weight in matrices.items():
        q = quantize_int8(weight, 32)
        assert torch.equal(dequantize_int8(q), weight), name
        assert int(q.values.abs().max()) == 127
    llm = LLM(str(path), show_progress=False)
    assert llm.engine.info.precision == "weights int8 (groups of 32), activations float32, KV cache float32"
    hf = hf_from_gguf(path)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for prompt in ["The moon rose over the quiet hills", "Once upon a time"]:
        ids = llm.engine.tokenizer.encode(prompt)
        out = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
        assert llm.generate([ids], params)[0].outputs[0].token_ids == out[0, len(ids):].tolist(), prompt
    # An explicit dtype still dequantizes the file.
    assert LLM(str(path), show_progress=False, dtype="float32").engine.info.precision.startswith("weights float32")


def int4_modules(model) -> dict[str, WeightOnlyLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, WeightOnlyLinear)}


def weight_of(module) -> torch.Tensor:
    return module.dequantize() if isinstance(module, WeightOnlyLinear) else module.weight


FUSED_ROWS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def by_hf_name(model, config) -> dict[str, torch.Tensor]:
    """Every linear's weight under its HF name, fused modules split back, int4 dequantized."""
    sizes = {"q_proj": config.num_heads * config.head_dim, "k_proj": config.kv_dim, "v_proj": config.kv_dim,
             "gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
    weights = {}
    for name, module in model.named_modules():
        if not hasattr(module, "in_features"):
            continue
        parent, _, leaf = name.rpartition(".")
        weight, start = weight_of(module), 0
        for part in FUSED_ROWS.get(leaf, ()):
            weights[f"{parent}.{part}.weight"] = weight[start:start + sizes[part]]
            start += sizes[part]
        if leaf not in FUSED_ROWS:
            weights[f"{name}.weight"] = weight
    return weights


@pytest.mark.parametrize("qtype,bytes_per_weight", [(Q.Q4_0, 0.5625), (Q.Q4_1, 0.625), (Q.Q4_K, 0.625)],
                         ids=["Q4_0", "Q4_1", "Q4_K"])
def test_4bit_tensors_become_int4_layers_equal_to_the_reference(gguf_dir, qtype, bytes_per_weight):
    path = write_llama_gguf(gguf_dir / f"{qtype.name}.gguf", qtype, tied=False, seed=1)
    config = load_model_config(path)
    loaded = load_model(path, config, torch.device("cpu"), torch.float32, show_progress=False, keep_int4=True)
    modules = int4_modules(loaded.model)
    # q/k/v, o, gate/up, down in both layers, and the LM head (output.weight); the embedding is no
    # linear and stays float.
    assert len(modules) == 4 * config.num_layers + 1 and "lm_head" in modules
    assert all(m.kind == "int4" and m.group_size == 32 for m in modules.values())
    assert loaded.checkpoint_int4.sources == {f"GGUF {qtype.name}"} and not loaded.checkpoint_int4.dequantized
    weights = sum(m.in_features * m.out_features for m in modules.values())
    assert sum(m.nbytes for m in modules.values()) / weights == bytes_per_weight
    reference = hf_from_gguf(path).state_dict()  # q/k rows unpermuted by transformers, as by kvik
    for name, weight in by_hf_name(loaded.model, config).items():
        if qtype != Q.Q4_K:  # d * q + m (Q4_1) and d * q - 8 d (Q4_0): float16 holds both exactly
            assert torch.equal(weight, reference[name]), name
    for name, module in modules.items():
        if qtype != Q.Q4_K:
            continue
        # Q4_K's d * sc and dmin * m are rounded to float16 once each: |error| <= 2**-11 (|scale| v +
        # |offset|), here taken from the rounded values (hence the 2**-10 margin).
        q = unpack_int4(module.data, module.scales, module.offsets, module.out_features, module.in_features, 32)
        bound = (q.values.float() * q.scales.float().abs().repeat_interleave(32, 1)
                 + q.offsets.float().abs().repeat_interleave(32, 1)) * 2.0**-11 * (1 + 2.0**-10)
        parent, _, leaf = name.rpartition(".")
        prefix = f"{parent}." if parent else ""
        expected = torch.cat([reference[f"{prefix}{part}.weight"] for part in FUSED_ROWS.get(leaf, (leaf,))])
        error = (module.dequantize() - expected).abs()
        assert (error <= bound).all() and error.max() > 0, (name, error.max())


def test_a_fused_module_with_a_piece_of_another_type_falls_back_to_float(gguf_dir, caplog):
    """The Q4_K_M-style mix: q (Q4_K) and k (Q4_0) share qkv_proj with v (Q6_K), which has no int4
    form, so qkv_proj is float; attn_output (Q4_1) is int4; everything equals transformers."""
    path = write_llama_gguf(gguf_dir / "mixed-int4.gguf", Q.Q8_0, tied=False, seed=3, types=MIXED)
    config = load_model_config(path)
    with caplog.at_level(logging.INFO, logger="kvik.model"):
        loaded = load_model(path, config, torch.device("cpu"), torch.float32, show_progress=False,
                            keep_int4=True)
    assert sorted(int4_modules(loaded.model)) == [f"model.layers.{i}.self_attn.o_proj" for i in range(2)]
    assert (loaded.checkpoint_int4.layers, loaded.checkpoint_int4.dequantized) == (2, 2)
    reference = hf_from_gguf(path).state_dict()
    for name, weight in by_hf_name(loaded.model, config).items():
        assert torch.equal(weight, reference[name]), name
    assert any(f"2 linear module(s) loaded as float instead of int4 because {FLOAT_PIECE}" in r.getMessage()
               for r in caplog.records)


def test_unsupported_architecture_is_a_clear_error(gguf_dir):
    path = gguf_dir / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="architecture 'gpt2'.*llama"):
        load_model_config(path)
