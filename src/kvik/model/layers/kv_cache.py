"""The paged KV cache's storage: float32, bfloat16, int8 with a scale per token and head, or fp8.

Shapes, for L layers, Hkv KV heads, N blocks of bs tokens and head_dim D:

- data: (L, 2, Hkv, N, bs, D) in the storage dtype (keys at index 0 of the second axis, values at 1);
- scales: (L, 2, Hkv, N, bs) float16, int8 only: token t of head h holds data * scale.

int8 is symmetric per token and head (scale = amax / 127, rounded to float16). A token's scale is
fixed when it is written, so a block never needs requantizing as it fills, chunked prefill and token-by-
token decoding store the same bytes, and one outlier token (an attention sink) cannot coarsen its
neighbours. The scales cost 2 bytes per head_dim bytes: 3.9x the tokens of float32 per byte at D=64.
fp8 is float8 e4m3fn (vLLM's `fp8` KV cache without calibrated scales): 1 byte per value and
nothing else, exactly 4x float32's tokens, with 3 mantissa bits (a relative error up to 1/16, where
int8's per-token scale keeps 7 bits of the row's largest value); magnitudes past 448 are stored as
448 (keys and values of the models served here stay far below it).
A prompt's own keys and values pass through `round_trip` before it attends to them, so attention
always sees what the cache returns, whether the prompt arrived whole, in chunks or after a prefix hit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvik.core.config import KV_CACHE_DTYPES
from kvik.core.errors import ConfigError

SCALE_DTYPE = torch.float16
INT8_LIMIT = 127.0
FLOAT8 = torch.float8_e4m3fn
FLOAT8_LIMIT = 448.0  # e4m3fn's largest finite value


def kv_storage_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for a --kv-cache-dtype name; auto follows the model's dtype."""
    if name == "auto":
        return compute_dtype
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype: {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8, "fp8": FLOAT8}[name]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token occupies in the cache across all layers, keys and values, scales included."""
    per_head = head_dim * dtype.itemsize + (SCALE_DTYPE.itemsize if dtype == torch.int8 else 0)
    return 2 * num_layers * num_kv_heads * per_head


@dataclass(slots=True)
class PagedKVCache:
    """KV storage for all layers, or one layer's view of it (without the leading L axis)."""

    data: torch.Tensor
    scales: torch.Tensor | None = None

    @classmethod
    def empty(cls, num_layers: int, num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int,
              dtype: torch.dtype, device: torch.device) -> PagedKVCache:
        """Uninitialised storage; the caller zeroes it (after advising huge pages, on the CPU)."""
        data = torch.empty(num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype,
                           device=device)
        scales = None
        if dtype == torch.int8:
            scales = torch.empty(num_layers, 2, num_kv_heads, num_blocks, block_size, dtype=SCALE_DTYPE,
                                 device=device)
        elif dtype not in (torch.float32, torch.bfloat16, torch.float16, FLOAT8):
            raise ValueError(f"KV cache dtype {dtype} is not supported")
        return cls(data, scales)

    def zero_(self) -> PagedKVCache:
        # Zeroed so that padding slots read by the batched gather are finite (masked afterwards).
        self.data.zero_()
        if self.scales is not None:
            self.scales.zero_()
        return self

    def layer(self, index: int) -> PagedKVCache:
        return PagedKVCache(self.data[index], None if self.scales is None else self.scales[index])

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        total = self.data.numel() * self.data.element_size()
        if self.scales is not None:
            total += self.scales.numel() * self.scales.element_size()
        return total

    # -- the PyTorch path (any device); the compiled CPU path has its own (write_kv, decode_attention) --

    def write(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """Store one layer's new keys and values, (T, Hkv, D) each, at their (T,) cache slots."""
        heads, dim = self.data.shape[1], self.data.shape[-1]
        for index, rows in ((0, keys), (1, values)):
            rows = rows.transpose(0, 1)  # (Hkv, T, D)
            target = self.data[index].view(heads, -1, dim)
            if self.scales is None:
                stored = to_storage(rows, self.data.dtype)
                if stored.dtype == FLOAT8:  # PyTorch has no float8 index_copy_: move the bytes
                    target, stored = target.view(torch.uint8), stored.view(torch.uint8)
                target.index_copy_(1, slots, stored)
            else:
                quantized, scales = quantize_kv(rows)
                target.index_copy_(1, slots, quantized)
                self.scales[index].view(heads, -1).index_copy_(1, slots, scales)

    def round_trip(self, rows: torch.Tensor) -> torch.Tensor:
        """(..., D) rows as the cache would return them after storing them: unchanged when the
        cache holds their dtype, else rounded (bfloat16) or quantized and dequantized (int8)."""
        if self.data.dtype == rows.dtype:
            return rows
        if self.scales is None:
            return to_storage(rows, self.data.dtype).to(rows.dtype)
        quantized, scales = quantize_kv(rows)
        return (quantized.to(rows.dtype) * scales.to(rows.dtype).unsqueeze(-1))

    def gather(self, index: int, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Keys (index 0) or values (1) of the blocks in (B, nb) tables as (B, Hkv, nb * bs, D) in
        `dtype`, inner dimensions contiguous."""
        cache = self.data[index]  # (Hkv, N, bs, D)
        heads, dim = cache.shape[0], cache.shape[-1]
        batch = block_tables.shape[0]
        flat = block_tables.reshape(-1)
        if cache.dtype == FLOAT8:  # no float8 index_select either: gather the bytes
            gathered = cache.view(torch.uint8).index_select(1, flat).view(FLOAT8).to(dtype)
        else:
            gathered = cache.index_select(1, flat).to(dtype)  # (Hkv, B * nb, bs, D)
        if self.scales is not None:
            scales = self.scales[index].index_select(1, flat).to(dtype)  # (Hkv, B * nb, bs)
            gathered = gathered * scales.unsqueeze(-1)
        return gathered.view(heads, batch, -1, dim).transpose(0, 1)


def to_storage(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows in a scale-free storage dtype. float8 saturates at +-448 first: PyTorch's own conversion
    saturates in some versions and gives NaN in others; the compiled write clamps the same way."""
    if dtype == FLOAT8:
        return rows.clamp(-FLOAT8_LIMIT, FLOAT8_LIMIT).to(FLOAT8)
    return rows.to(dtype)


def quantize_kv(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of the last dimension: (..., D) -> (int8 (..., D), float16 (...)).

    The arithmetic matches the compiled write (csrc/paged_attention_cpu.cpp, write_kv) bit for bit:
    scale = float16(amax * (1/127)); q = round_half_even(x * (1/scale)) clamped to [-127, 127]."""
    rows = rows.float()
    amax = rows.abs().amax(dim=-1)
    scales = (amax * (1.0 / INT8_LIMIT)).to(SCALE_DTYPE)
    wide = scales.float()
    inverse = torch.where(wide > 0, 1.0 / wide, torch.zeros_like(wide))
    quantized = torch.round(rows * inverse.unsqueeze(-1)).clamp_(-INT8_LIMIT, INT8_LIMIT).to(torch.int8)
    return quantized, scales
