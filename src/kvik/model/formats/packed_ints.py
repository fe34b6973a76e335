"""Unpack the low-bit integers GPTQ and AWQ checkpoints store packed in int32 words."""

from __future__ import annotations

import torch


def unpack_int32(packed: torch.Tensor, bits: int, dim: int,
                 order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Split each int32 of `packed` into 32 // bits unsigned values along `dim`.

    Value j of a word sits at bits [j * bits, (j + 1) * bits). Without `order`, value j of word w
    becomes element w * per_word + j along `dim`; with it, element w * per_word + order[j]
    (AWQ's interleaved layout). Returns int32 values in [0, 2**bits)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed tensor must be int32, got {packed.dtype}")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    moved = packed.movedim(dim, -1)
    # (..., words, per_word): an arithmetic shift sign-extends, the mask keeps the low bits.
    values = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    if order is not None:
        placed = torch.empty_like(values)
        placed[..., list(order)] = values
        values = placed
    return values.flatten(-2).movedim(-1, dim)
