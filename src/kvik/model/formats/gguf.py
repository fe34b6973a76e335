"""Read GGUF files (llama.cpp's checkpoint format): model config from the metadata, weights
dequantized to the serving dtype at load, or the 4-bit types (Q4_0/Q4_1/Q4_K) kept as kvik's int4
(`keep_int4`, see `kvik.model.formats.gguf_int4`).

The `gguf` package (llama.cpp's own reader) parses the file and dequantizes every tensor type it
knows (F32/F16/BF16, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, the K-quants Q2_K..Q6_K, ...), so kvik's weights are
bit-for-bit that package's reference dequantization. What kvik adds is the mapping to HF names (via
the package's `TensorNameMap`) and undoing the row permutation llama.cpp's converter applies to the
q/k projections of llama-type models.

Parsing the metadata of a file with a 50k-token vocabulary takes seconds (the reader builds one numpy
view per string), so the last reader opened is kept for the config and weight reads that follow it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvik.core.errors import ConfigError, MissingWeightsError
from kvik.model.formats.gguf_int4 import INT4_TYPES, gguf_int4
from kvik.model.quant.prequantized import PrequantizedWeight
from kvik.model.quant.reference import Int4Weight

logger = logging.getLogger("kvik.model")

GGUF_SUFFIX = ".gguf"

# GGUF `general.architecture` -> the HF architecture kvik builds. Mistral GGUFs say "llama".
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Architectures whose q/k rows llama.cpp's convert_hf_to_gguf.py permutes (its LlamaModel).
PERMUTED_QK = frozenset({"llama"})


def is_gguf_file(path: Path) -> bool:
    return path.suffix.lower() == GGUF_SUFFIX and path.is_file()


@lru_cache(maxsize=1)
def _reader(path: str, mtime_ns: int) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"model: {path} is not a readable GGUF file ({exc})") from exc


def open_gguf(path: Path) -> Any:
    """The `gguf.GGUFReader` of `path`, parsed once per process while the file is unchanged."""
    resolved = path.resolve()
    return _reader(str(resolved), resolved.stat().st_mtime_ns)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_hf_config(path: Path) -> dict[str, Any]:
    """An HF `config.json`-shaped dict built from the GGUF metadata (the keys kvik reads)."""
    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"model: {path.name} is a GGUF of architecture {arch!r}; kvik loads GGUF "
                          f"files of {', '.join(sorted(ARCHITECTURES))}")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1-style rope scaling is stored as precomputed per-frequency factors, not as the
        # parameters kvik's rotary embedding takes.
        raise ConfigError(f"model: {path.name} carries rope frequency factors (rope_freqs.weight), "
                          "which kvik's GGUF loader does not apply; load the HF checkpoint instead")

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    hidden = key("embedding_length")
    heads = key("attention.head_count")
    if hidden is None or heads is None or key("block_count") is None:
        raise ConfigError(f"model: {path.name} lacks {arch}.embedding_length, block_count or "
                          "attention.head_count in its metadata")
    head_dim = key("attention.key_length") or hidden // heads
    rotary_dims = key("rope.dimension_count", head_dim)
    if rotary_dims != head_dim:
        raise ConfigError(f"model: {path.name} rotates {rotary_dims} of {head_dim} dims per head "
                          "(partial rotary), which kvik does not implement")
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise MissingWeightsError(f"{path.name} has no token_embd.weight tensor")
    eos = [_field(reader, f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    raw: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        # The embedding's rows, not the token list: Qwen pads the matrix beyond the vocabulary.
        "vocab_size": int(embedding.shape[-1]),
        "hidden_size": hidden,
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "intermediate_size": key("feed_forward_length"),
        "max_position_embeddings": key("context_length", 2048),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": key("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "eos_token_id": list(dict.fromkeys(i for i in eos if i is not None)),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
    }
    scaling = key("rope.scaling.type", "none")
    if scaling == "linear":
        raw["rope_scaling"] = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
    elif scaling != "none":
        raise ConfigError(f"model: {path.name} uses rope scaling {scaling!r}; kvik's GGUF loader "
                          "supports none and linear")
    return raw


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's q/k permutation. Per head, HF keeps the rotary halves apart
    (rows [x0..x_{d/2-1}, y0..y_{d/2-1}]) while GGUF interleaves them ([x0, y0, x1, y1, ...]).
    weight: (num_heads * head_dim, in) or a bias (num_heads * head_dim,), GGUF order -> HF order."""
    rows = weight.shape[0]
    split = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def _unpermute_int4(q: Int4Weight, num_heads: int) -> Int4Weight:
    """The same row permutation undone on int4 codes, scales and offsets alike."""
    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.from_numpy(np.ascontiguousarray(_unpermute_rows(t.numpy(), num_heads)))

    return Int4Weight(rows(q.values), rows(q.scales), rows(q.offsets), q.group_size)


def _hf_name_of(reader: Any, arch: str, num_layers: int, expected: set[str]) -> dict[str, str]:
    """GGUF tensor name -> HF checkpoint name, for the names the model expects."""
    import gguf

    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_enum, num_layers)
    mapping: dict[str, str] = {}
    for hf_name in expected | {"lm_head.weight"}:
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            mapping[gguf_name] = hf_name
    return mapping


def gguf_q8_0_linears(path: Path) -> bool:
    """Whether every 2-D tensor of the file but the token embedding is Q8_0 (what llama.cpp's
    converter writes with --outtype q8_0). kvik then serves its linear layers as int8 with a float16
    scale per 32 inputs: Q8_0's own layout, and requantizing Q8_0's dequantized weights to it gives
    back the file's codes and scales exactly (the largest code of a block is +-127, so the scale
    found is the block's d, and q * d / d = q in float32)."""
    matrices = [t for t in open_gguf(path).tensors if len(t.shape) == 2 and t.name != "token_embd.weight"]
    return bool(matrices) and all(t.tensor_type.name == "Q8_0" for t in matrices)


def gguf_prequantized_names(path: Path, raw_config: dict[str, Any], expected: set[str]) -> set[str]:
    """HF names of the tensors `gguf_tensors(keep_int4=True)` yields as a PrequantizedWeight."""
    reader = open_gguf(path)
    name_map = _hf_name_of(reader, raw_config["model_type"], raw_config["num_hidden_layers"], expected)
    return {name_map[t.name] for t in reader.tensors
            if t.tensor_type.name in INT4_TYPES and len(t.shape) == 2 and t.name in name_map}


def gguf_tensors(path: Path, raw_config: dict[str, Any], expected: set[str],
                 show_progress: bool = True, keep_int4: bool = False,
                 ) -> Iterator[tuple[str, torch.Tensor | PrequantizedWeight]]:
    """(HF checkpoint name, float32 tensor) for every tensor of the file, dequantized by `gguf`; with
    `keep_int4`, 2-D Q4_0/Q4_1/Q4_K tensors come as a PrequantizedWeight instead.

    `expected` holds the HF checkpoint names the model will ask for; a GGUF tensor that maps to none
    of them is yielded under its GGUF name, so the loader reports it as unused."""
    from tqdm import tqdm

    reader = open_gguf(path)
    arch = raw_config["model_type"]
    name_map = _hf_name_of(reader, arch, raw_config["num_hidden_layers"], expected)
    heads = {"attn_q": raw_config["num_attention_heads"],
             "attn_k": raw_config["num_key_value_heads"]}
    for tensor in tqdm(reader.tensors, desc=f"Loading {path.name}", unit="tensor",
                       disable=not show_progress, leave=False):
        kind = tensor.name.split(".")[-2] if tensor.name.startswith("blk.") else ""
        permuted_heads = heads[kind] if arch in PERMUTED_QK and kind in heads else None  # weights and biases
        name = name_map.get(tensor.name, tensor.name)
        type_name = tensor.tensor_type.name
        if keep_int4 and type_name in INT4_TYPES and len(tensor.shape) == 2:
            yield name, _prequantized(path, tensor, permuted_heads)
        else:
            yield name, _dequantized(path, tensor, permuted_heads)


def _dequantized(path: Path, tensor: Any, permuted_heads: int | None) -> torch.Tensor:
    import gguf

    try:
        values = gguf.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ConfigError(f"model: {path.name} tensor {tensor.name} is of type "
                          f"{tensor.tensor_type.name}, which the gguf package cannot "
                          "dequantize") from exc
    if permuted_heads is not None:
        values = _unpermute_rows(values, permuted_heads)
    # A float32 tensor comes back as a read-only view of the memory-mapped file: copy it out.
    return torch.from_numpy(np.array(values, np.float32))


def _prequantized(path: Path, tensor: Any, permuted_heads: int | None) -> PrequantizedWeight:
    source = f"GGUF {tensor.tensor_type.name}"
    shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF lists dims innermost first

    def dequantize() -> torch.Tensor:
        return _dequantized(path, tensor, permuted_heads)

    int4 = gguf_int4(tensor.data, tensor.tensor_type.name)
    if isinstance(int4, str):
        return PrequantizedWeight.unfit(source, shape, int4, dequantize)
    assert int4 is not None  # INT4_TYPES are the types gguf_int4 decodes
    if permuted_heads is not None:
        int4 = _unpermute_int4(int4, permuted_heads)
    return PrequantizedWeight(source, shape, int4, "", dequantize)
