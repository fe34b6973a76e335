"""kvik's blocked weight layout, read by the CPU kernels (csrc/weight_only_cpu.cpp).

Output rows are taken in blocks of BLOCK = 16 (the last block padded with zero rows); within a block
the weights are stored input-major, (K, 16): the 16 rows' weights for input k side by side, so one
vector load serves 16 outputs. int4 puts rows j and j + 8 of a block into the low and high nibble
of byte j, (K, 8) bytes per block. Scales follow the rows: int8 per row (blocks * 16,) float32;
int8 with groups and int4 (blocks, G, 16) float16, int4's offsets alike.

`unpack_*` invert the packing exactly: the PyTorch path (CUDA, or no compiler) dequantizes from the
packed buffers through them, so every device holds the same bytes.
"""

from __future__ import annotations

import torch

from kvik.model.quant.reference import Int4Weight, Int8Weight

BLOCK = 16
HALF = BLOCK // 2


def num_blocks(out_features: int) -> int:
    return -(-out_features // BLOCK)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def to_blocks(matrix: torch.Tensor) -> torch.Tensor:
    """(N, K) -> (blocks, K, 16), rows padded with zeros."""
    rows, columns = matrix.shape
    blocks = num_blocks(rows)
    return _pad_rows(matrix, blocks * BLOCK).view(blocks, BLOCK, columns).transpose(1, 2).contiguous()


def from_blocks(blocked: torch.Tensor, out_features: int) -> torch.Tensor:
    """(blocks, K, 16) -> (N, K)."""
    blocks, columns, _ = blocked.shape
    return blocked.transpose(1, 2).reshape(blocks * BLOCK, columns)[:out_features]


def pack_bfloat16(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) float -> (blocks, K, 16) bfloat16."""
    return to_blocks(weight.detach().to(torch.bfloat16))


def unpack_bfloat16(data: torch.Tensor, out_features: int) -> torch.Tensor:
    return from_blocks(data, out_features)


def pack_int8(q: Int8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """-> data (blocks, K, 16) int8, scales (blocks * 16,) float32 per row (zero for padded rows)
    or (blocks, G, 16) float16 per group."""
    if q.group_size:
        return to_blocks(q.values), to_blocks(q.scales)
    rows = num_blocks(q.values.shape[0]) * BLOCK
    return to_blocks(q.values), _pad_rows(q.scales.float(), rows).contiguous()


def unpack_int8(data: torch.Tensor, scales: torch.Tensor, out_features: int, group_size: int = 0) -> Int8Weight:
    if group_size:
        return Int8Weight(from_blocks(data, out_features), from_blocks(scales, out_features), group_size)
    return Int8Weight(from_blocks(data, out_features), scales[:out_features])


def pack_int4(q: Int4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """-> data (blocks, K, 8) uint8, scales (blocks, G, 16) float16, offsets like scales or None."""
    blocked = to_blocks(q.values)  # (blocks, K, 16)
    data = (blocked[..., :HALF] | (blocked[..., HALF:] << 4)).contiguous()
    scales = to_blocks(q.scales)  # (blocks, G, 16)
    offsets = None if q.offsets is None else to_blocks(q.offsets)
    return data, scales, offsets


def unpack_int4(data: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, out_features: int,
                group_size: int) -> Int4Weight:
    values = torch.cat([data & 15, data >> 4], dim=-1)  # (blocks, K, 16)
    return Int4Weight(from_blocks(values, out_features), from_blocks(scales, out_features),
                      None if offsets is None else from_blocks(offsets, out_features), group_size)
