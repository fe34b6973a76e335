"""kvik's blocked weight layout, read by the CPU kernels (csrc/weight_only_cpu.cpp).

Output rows are taken in blocks of BLOCK = 16 (the last block padded with zero rows); within a block
the weights are stored input-major, (K, 16): the 16 rows' weights for input k side by side, so one
vector load serves 16 outputs. int4 takes the inputs eight at a time: per block, chunks of 64 bytes
(C = ceil(K / 8) of them, the last padded with zeros), row j's eight inputs in bytes 4j..4j+3 of
its chunk, input 8c + i in the low nibble of byte 4j + i and input 8c + 4 + i in the high one, so
that masking a chunk's low or high nibbles gives each row's four consecutive inputs in one 32-bit
lane (what AVX512-VNNI's vpdpbusd multiplies). Scales follow the rows: int8 per row
(blocks * 16,) float32; int8 with groups and int4 (blocks, G, 16) float16, int4's offsets alike.

`unpack_*` invert the packing exactly: the PyTorch path (CUDA, or no compiler) dequantizes from the
packed buffers through them, so every device holds the same bytes.
"""

from __future__ import annotations

import torch

from kvik.model.quant.reference import Int4Weight, Int8Weight

BLOCK = 16
INT4_CHUNK = 8  # inputs per int4 chunk of 64 bytes


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
    """-> data (blocks, ceil(K / 8), 64) uint8, scales (blocks, G, 16) float16, offsets like scales
    or None."""
    blocked = to_blocks(q.values)  # (blocks, K, 16)
    blocks, columns, _ = blocked.shape
    chunks = -(-columns // INT4_CHUNK)
    padded = torch.cat([blocked, blocked.new_zeros(blocks, chunks * INT4_CHUNK - columns, BLOCK)], dim=1)
    # (blocks, chunk, half, i, row) -> (blocks, chunk, row, i, half): byte (4 row + i) of a chunk
    nibbles = padded.view(blocks, chunks, 2, 4, BLOCK).permute(0, 1, 4, 3, 2)
    data = (nibbles[..., 0] | (nibbles[..., 1] << 4)).reshape(blocks, chunks, 4 * BLOCK).contiguous()
    scales = to_blocks(q.scales)  # (blocks, G, 16)
    offsets = None if q.offsets is None else to_blocks(q.offsets)
    return data, scales, offsets


def unpack_int4(data: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, out_features: int,
                in_features: int, group_size: int) -> Int4Weight:
    blocks, chunks, _ = data.shape
    lanes = data.view(blocks, chunks, BLOCK, 4)  # (blocks, chunk, row, i)
    nibbles = torch.stack([lanes & 15, lanes >> 4], dim=2)  # (blocks, chunk, half, row, i)
    values = nibbles.transpose(3, 4).reshape(blocks, chunks * INT4_CHUNK, BLOCK)[:, :in_features]
    return Int4Weight(from_blocks(values, out_features), from_blocks(scales, out_features),
                      None if offsets is None else from_blocks(offsets, out_features), group_size)
