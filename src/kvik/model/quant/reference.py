"""Weight quantization in plain PyTorch: the definitions every other path must reproduce.

- int8: symmetric, w ~ q * s, q in [-127, 127], s = amax / 127: one float16 scale per output row and
  group of `group_size` inputs (32 by default: llama.cpp's Q8_0), or one float32 scale per output row
  (`group_size` 0: 6 % fewer bytes than groups of 32, but a row's small weights are rounded on the
  step its largest one sets).
- int4: one float16 scale per output row and group of `group_size` consecutive inputs (the last group
  of a row may be shorter). Symmetric: w ~ (u - 8) * s with u in [1, 15], s = amax / 7. With zero
  points: w ~ (u - z) * s with u, z in [0, 15], s = (max - min) / 15 over the group's range widened
  to include 0 (so z is an integer in range and 0 is exact), stored as the float16 offset -z * s.
- bfloat16: round to nearest even.

Scales are rounded to float16 before the values are computed from them, so the stored scale is the
one the values were fitted to. All of it works on any device (CUDA included); the packed layouts the
CPU kernels read are in kvik.model.quant.packing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP_SIZES = (32, 64, 128)
INT8_GROUP_SIZES = (0, 32, 64, 128)  # 0: one scale per output row
# Inputs per scale when none is asked for (`--quantization-group-size` unset).
DEFAULT_GROUP_SIZES = {"int4": 64, "int8": 32}


@dataclass(slots=True)
class Int8Weight:
    values: torch.Tensor  # (N, K) int8
    scales: torch.Tensor  # (N,) float32, or (N, G) float16 with groups
    group_size: int = 0  # 0: a scale per output row


@dataclass(slots=True)
class Int4Weight:
    values: torch.Tensor  # (N, K) uint8 in [0, 15]
    scales: torch.Tensor  # (N, G) float16, G = ceil(K / group_size)
    offsets: torch.Tensor | None  # (N, G) float16 with zero points; None: symmetric (offset = -8 s)
    group_size: int


def quantize_int8(weight: torch.Tensor, group_size: int = 0) -> Int8Weight:
    if group_size < 0:
        raise ValueError(f"group_size must be 0 (per row) or positive, got {group_size}")
    w = weight.detach().float()
    if group_size == 0:
        scales = w.abs().amax(dim=1) / 127.0
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        values = torch.round(w / safe[:, None]).clamp_(-127, 127).to(torch.int8)
        return Int8Weight(values, scales)
    rows, columns = w.shape
    grouped = _grouped(w, group_size)  # (N, G, g)
    scales = (grouped.abs().amax(dim=-1) / 127.0).to(torch.float16)
    wide = scales.float()
    safe = torch.where(wide > 0, wide, torch.ones_like(wide))
    values = torch.round(grouped / safe[..., None]).clamp_(-127, 127).view(rows, -1)[:, :columns]
    return Int8Weight(values.to(torch.int8).contiguous(), scales, group_size)


def _per_input(scales: torch.Tensor, group_size: int, columns: int) -> torch.Tensor:
    """(N, G) per-group values -> (N, K), each repeated over its group's inputs."""
    return scales.float().repeat_interleave(group_size, dim=1)[:, :columns]


def dequantize_int8(q: Int8Weight) -> torch.Tensor:
    if q.group_size == 0:
        return q.values.float() * q.scales[:, None]
    return q.values.float() * _per_input(q.scales, q.group_size, q.values.shape[1])


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N, K) -> (N, G, group_size), a short last group padded with copies of the row's last
    input (they change neither its range nor its absolute maximum, and are dropped again)."""
    rows, columns = w.shape
    groups = -(-columns // group_size)
    pad = groups * group_size - columns
    if pad:
        w = torch.cat([w, w[:, -1:].expand(rows, pad)], dim=1)
    return w.view(rows, groups, group_size)


def quantize_int4(weight: torch.Tensor, group_size: int, zero_point: bool = False) -> Int4Weight:
    if group_size < 1:
        raise ValueError(f"group_size must be positive, got {group_size}")
    w = weight.detach().float()
    rows, columns = w.shape
    grouped = _grouped(w, group_size)  # (N, G, g)
    if zero_point:
        low = grouped.amin(dim=-1).clamp(max=0)
        high = grouped.amax(dim=-1).clamp(min=0)
        scales = ((high - low) / 15.0).to(torch.float16)
    else:
        scales = (grouped.abs().amax(dim=-1) / 7.0).to(torch.float16)
    wide = scales.float()
    safe = torch.where(wide > 0, wide, torch.ones_like(wide))
    if zero_point:
        zeros = torch.round(-low / safe).clamp_(0, 15)
        values = (torch.round(grouped / safe[..., None]) + zeros[..., None]).clamp_(0, 15)
        offsets = (-zeros * wide).to(torch.float16)
    else:
        values = torch.round(grouped / safe[..., None]).clamp_(-8, 7) + 8
        offsets = None
    values = values.view(rows, -1)[:, :columns].to(torch.uint8)
    return Int4Weight(values.contiguous(), scales, offsets, group_size)


def dequantize_int4(q: Int4Weight) -> torch.Tensor:
    rows, columns = q.values.shape
    scales = _per_input(q.scales, q.group_size, columns)
    offsets = -8.0 * scales if q.offsets is None else _per_input(q.offsets, q.group_size, columns)
    return q.values.float() * scales + offsets
