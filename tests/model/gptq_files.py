"""Write small GPTQ and AWQ checkpoints from known integer codes: a float model's decoder linears
replaced by random codes, zero points and float16 scales in each format's packing, written from the
formats' definitions (no code shared with kvik's unpacking). The reference weights are the formula,
scale * (code - zero), applied to the codes before packing."""

from __future__ import annotations

import json
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
GROUP = 32
AWQ_COLUMN_OF_NIBBLE = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of a word holds column 8w + this[j]


def pack_words(codes: np.ndarray, bits: int, axis: int, column_of=None) -> np.ndarray:
    """Pack unsigned `bits`-bit codes into int32 words along `axis`, value j at bit j * bits."""
    per_word = 32 // bits
    codes = np.moveaxis(codes.astype(np.int64), axis, -1)
    words = np.zeros(codes.shape[:-1] + (codes.shape[-1] // per_word,), np.int64)
    for w in range(words.shape[-1]):
        for j in range(per_word):
            column = w * per_word + (column_of[j] if column_of else j)
            words[..., w] |= codes[..., column] << (j * bits)
    return np.ascontiguousarray(np.moveaxis(words.astype(np.uint32).view(np.int32), -1, axis))


def quantized_copy(source, target, method: str, bits: int = 4, fmt: str = "gptq", act_order=False,
                   seed: int = 0, group: int = GROUP, symmetric: bool = False, keep_float: tuple[str, ...] = (),
                   zero_times_scale: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Copy the model at `source` to `target` with every decoder linear replaced by random codes in
    `method`'s layout (zero points all 8 when `symmetric`; linears whose names end with one of
    `keep_float` stay float); returns the float32 (out, in) weight each linear stands for, and fills
    `zero_times_scale` with |zero * scale| per weight (out, in)."""
    rng = np.random.default_rng(seed)
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    expected: dict[str, torch.Tensor] = {}
    for name in [n for n in tensors if n.endswith(".weight") and n.rsplit(".", 1)[0].endswith(LINEARS)]:
        module = name.removesuffix(".weight")
        if module.endswith(keep_float):
            expected[name] = tensors[name]
            continue
        out_features, in_features = tensors.pop(name).shape
        groups = in_features // group
        codes = rng.integers(0, 2**bits, size=(in_features, out_features))
        zeros = rng.integers(1, 2**bits, size=(groups, out_features))  # v1 GPTQ stores zero - 1 >= 0
        if symmetric:
            zeros[:] = 2 ** (bits - 1)
        scales = rng.uniform(0.02, 0.06, size=(groups, out_features)).astype(np.float16)
        group_of = np.arange(in_features) // group
        if act_order:
            group_of = rng.permutation(group_of)
        weight = scales.astype(np.float32)[group_of] * (codes - zeros[group_of])
        expected[name] = torch.from_numpy(weight.T.astype(np.float32))
        if zero_times_scale is not None:
            zero_times_scale[name] = torch.from_numpy((zeros[group_of] * scales.astype(np.float32)[group_of]).T)
        if method == "gptq":
            stored_zeros = zeros - 1 if fmt == "gptq" else zeros
            tensors[f"{module}.qweight"] = torch.from_numpy(pack_words(codes, bits, axis=0))
            tensors[f"{module}.qzeros"] = torch.from_numpy(pack_words(stored_zeros, bits, axis=1))
            tensors[f"{module}.g_idx"] = torch.from_numpy(group_of.astype(np.int32))
        else:
            tensors[f"{module}.qweight"] = torch.from_numpy(
                pack_words(codes, 4, axis=1, column_of=AWQ_COLUMN_OF_NIBBLE))
            tensors[f"{module}.qzeros"] = torch.from_numpy(
                pack_words(zeros, 4, axis=1, column_of=AWQ_COLUMN_OF_NIBBLE))
        tensors[f"{module}.scales"] = torch.from_numpy(scales)
    save_file(tensors, str(target / "model.safetensors"))
    config = json.loads((target / "config.json").read_text())
    if method == "gptq":
        config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group,
                                         "desc_act": act_order, "sym": symmetric,
                                         "checkpoint_format": fmt}
    else:
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group,
                                         "zero_point": True, "version": "gemm"}
    (target / "config.json").write_text(json.dumps(config))
    return expected


def float_copy(source, target, weights: dict[str, torch.Tensor]) -> None:
    """The same model with the dequantized weights stored as floats: HF's reference input."""
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    tensors.update({name: w.contiguous() for name, w in weights.items()})
    save_file(tensors, str(target / "model.safetensors"))
