"""GGUF's 4-bit tensor types as kvik's int4 (groups of 32), straight from their blocks.

Each row of a quantized GGUF tensor is a run of blocks (llama.cpp's ggml-common.h layouts):
  Q4_0  32 weights: d (fp16), 16 bytes of codes           w = d * (q - 8)
  Q4_1  32 weights: d, m (fp16), 16 bytes of codes        w = d * q + m
  Q4_K  256 weights: d, dmin (fp16), 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32,
        128 bytes of codes                                w = d * sc[j] * q - dmin * m[j]
In a Q4_0/Q4_1 block, byte i holds weight i in its low nibble and weight i + 16 in its high one; a
Q4_K block's codes are four runs of 32 bytes, run r holding sub-block 2r in the low nibbles and 2r + 1
in the high ones. The 6-bit scale/min unpacking is the `gguf` package's own (`Q4_K.get_scale_min`).

Q4_0 maps exactly (symmetric int4: scale d, offset -8 d) and so does Q4_1 (scale d, offset m). Q4_K's
per-sub-block scale d * sc and offset -dmin * m are rounded to float16 (the one rounding, 2**-11 of
each at most). Other types (Q5_*, Q6_K, Q8_0, ...) have no int4 form and are dequantized to float;
a file of Q8_0 matrices is then quantized again to kvik's int8 with groups of 32, which gives back
its codes and scales exactly (`kvik.model.formats.gguf.gguf_q8_0_linears`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvik.model.quant.reference import Int4Weight

GROUP = 32


def _nibbles_of_32(codes: np.ndarray) -> np.ndarray:
    """(..., 16) bytes -> (..., 32) codes: low nibbles first, then high nibbles."""
    return np.concatenate([codes & 0x0F, codes >> 4], axis=-1)


def _blocks(data: np.ndarray, block_bytes: int) -> np.ndarray:
    rows = data.shape[0]
    return np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1, block_bytes)


def _half(column: np.ndarray) -> np.ndarray:
    """(..., 2) bytes -> (...) float16."""
    return np.ascontiguousarray(column).view(np.float16)[..., 0]


def q4_0(data: np.ndarray) -> Int4Weight:
    blocks = _blocks(data, 18)  # (rows, K / 32, 18)
    rows = blocks.shape[0]
    values = _nibbles_of_32(blocks[..., 2:]).reshape(rows, -1)
    return Int4Weight(torch.from_numpy(values), torch.from_numpy(_half(blocks[..., 0:2])), None, GROUP)


def q4_1(data: np.ndarray) -> Int4Weight:
    blocks = _blocks(data, 20)
    rows = blocks.shape[0]
    values = _nibbles_of_32(blocks[..., 4:]).reshape(rows, -1)
    return Int4Weight(torch.from_numpy(values), torch.from_numpy(_half(blocks[..., 0:2])),
                      torch.from_numpy(_half(blocks[..., 2:4])), GROUP)


def q4_k(data: np.ndarray) -> Int4Weight | str:
    import gguf

    blocks = _blocks(data, 144)  # (rows, K / 256, 144)
    rows, supers = blocks.shape[:2]
    d = _half(blocks[..., 0:2]).astype(np.float32)[..., None]  # (rows, supers, 1)
    dmin = _half(blocks[..., 2:4]).astype(np.float32)[..., None]
    sc, mins = gguf.quants.Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
    sc = sc.reshape(rows, supers, 8).astype(np.float32)
    mins = mins.reshape(rows, supers, 8).astype(np.float32)
    codes = blocks[..., 16:].reshape(rows, supers, 4, 32)
    values = np.stack([codes & 0x0F, codes >> 4], axis=3).reshape(rows, -1)  # sub-blocks 2r, 2r + 1
    with np.errstate(over="ignore"):
        # d * sc is exact in float32 (11 x 6 significant bits); one rounding to float16 each.
        scales = (d * sc).reshape(rows, -1).astype(np.float16)
        offsets = (-(dmin * mins)).reshape(rows, -1).astype(np.float16)
    if not (np.isfinite(scales).all() and np.isfinite(offsets).all()):
        return "Q4_K scales overflow float16"
    return Int4Weight(torch.from_numpy(values), torch.from_numpy(scales), torch.from_numpy(offsets), GROUP)


def gguf_int4(data: np.ndarray, type_name: str) -> Int4Weight | str | None:
    """kvik's int4 (values (rows, K), float16 scales/offsets per 32) of a GGUF tensor's raw rows of
    type `type_name`; a reason string when a 4-bit tensor does not fit; None for other types."""
    decode: Any = {"Q4_0": q4_0, "Q4_1": q4_1, "Q4_K": q4_k}.get(type_name)
    return None if decode is None else decode(data)


INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})
