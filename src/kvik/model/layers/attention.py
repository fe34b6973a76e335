"""Paged attention over a flat token batch, in plain PyTorch.

The KV cache of one layer (kvik.model.layers.kv_cache.PagedKVCache) holds a tensor (2, num_kv_heads,
num_blocks, block_size, head_dim) in float32, bfloat16 or int8 (with per-token scales); a token at
absolute position p of a sequence lives in slot `block_table[p // block_size] * block_size +
p % block_size` of every head. Heads come first so that gathering a sequence's blocks yields
(heads, tokens, head_dim) with the last two dimensions contiguous, which is what the CPU SDPA kernels
want (a strided layout is several times slower). Each step writes the new tokens' keys and values into
their slots, then attends:

- decodes (one query token per sequence; they come first in the batch) in one batched SDPA call over
  keys gathered through the block tables, padded to the longest sequence and masked (the mask is
  built on first use, so a step served by the compiled CPU kernel never builds it);
- prefill chunks one SDPA call each: causal over their own keys when nothing precedes them, else over
  the gathered context plus themselves with an offset causal mask (chunked prefill, prefix hits,
  recompute after preemption).

`AttentionMetadata` is built once per step by the model runner and shared by every layer. A CUDA
kernel (FlashAttention/FlashInfer with block tables) can replace `PagedAttention.forward` without the
scheduler or the models noticing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kvik.model.layers.kv_cache import PagedKVCache


@dataclass(slots=True)
class PrefillSpan:
    query_start: int  # offset of the chunk's first token in the flat batch
    query_len: int
    context_len: int  # tokens of this sequence already in the cache before the chunk
    block_table: torch.Tensor | None  # (n,) long: blocks covering context_len + query_len tokens
    mask: torch.Tensor | None  # (query_len, context_len + query_len) bool, True = attend


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) long: cache slot of every token in the batch
    num_decodes: int = 0  # the first num_decodes tokens are one-token decodes, one per sequence
    decode_block_tables: torch.Tensor | None = None  # (num_decodes, max_blocks) long
    decode_mask: torch.Tensor | None = None  # (num_decodes, 1, 1, max_blocks * block_size) bool, lazily
    decode_seq_lens: torch.Tensor | None = None  # (num_decodes,) long: tokens each decode attends
    prefills: list[PrefillSpan] = field(default_factory=list)


class PagedAttention(nn.Module):
    """Paged attention in plain PyTorch: the reference path, and the one CUDA runs. Subclasses (the
    compiled CPU path in kvik.model.transforms) replace `store` and `attend_decodes`."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.gqa = num_heads != num_kv_heads
        # This layer's view of the cache, bound by kvik.model.transforms.bind_kv_cache once the model
        # runner has allocated it; not a parameter or buffer, so it never appears in state dicts.
        self.kv_cache: PagedKVCache | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: (T, H, D); k, v: (T, Hkv, D) -> (T, H * D)."""
        assert self.kv_cache is not None, "KV cache not bound: the model runner binds it"
        num_tokens = q.shape[0]
        self.store(k, v, meta.slot_mapping)
        out = q.new_empty(num_tokens, self.num_heads, self.head_dim)
        if meta.num_decodes:
            self.attend_decodes(q[:meta.num_decodes], meta, out[:meta.num_decodes])
        self.attend_prefills(q, k, v, meta, out)
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        self.kv_cache.write(k, v, slots)

    def attend_decodes(self, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor) -> None:
        """One query token per sequence, q (B, H, D), into out (B, H, D): batched SDPA over keys
        gathered through the block tables, padded to the longest sequence and masked."""
        tables = meta.decode_block_tables
        if meta.decode_mask is None:  # built once per step, by the first layer that needs it
            key_positions = torch.arange(tables.shape[1] * self.kv_cache.data.shape[-2], device=q.device)
            meta.decode_mask = (key_positions[None, :] < meta.decode_seq_lens[:, None])[:, None, None, :]
        keys = self.kv_cache.gather(0, tables, q.dtype)  # (B, Hkv, L, D)
        values = self.kv_cache.gather(1, tables, q.dtype)
        attended = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask,
                                                  scale=self.scale, enable_gqa=self.gqa)
        out.copy_(attended.squeeze(2))

    def attend_prefills(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                        out: torch.Tensor) -> None:
        """Each prefill chunk: causal over its own keys when nothing precedes it, else over the cached
        context plus itself with an offset causal mask."""
        for span in meta.prefills:
            start, end = span.query_start, span.query_start + span.query_len
            # 4-D (1, H, n, D): the 3-D form misses the fused CPU kernels.
            query = q[start:end].transpose(0, 1).unsqueeze(0)
            keys, values = (t.transpose(0, 1).unsqueeze(0) for t in self.span_keys_values(span, k, v, q.dtype))
            if span.context_len == 0:
                attended = F.scaled_dot_product_attention(query, keys, values, is_causal=True,
                                                          scale=self.scale, enable_gqa=self.gqa)
            else:
                attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=span.mask,
                                                          scale=self.scale, enable_gqa=self.gqa)
            out[start:end] = attended[0].transpose(0, 1)

    def span_keys_values(self, span: PrefillSpan, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values a prefill chunk attends, (context + chunk, Hkv, D) each in `dtype`:
        its own as a read back from the cache returns them when nothing precedes it (so that a
        narrow cache gives the same result whether a prompt arrives whole or in chunks, or shares a
        prefix), else the cached context and itself gathered through its block table."""
        start, end = span.query_start, span.query_start + span.query_len
        if span.context_len == 0:
            return self.kv_cache.round_trip(k[start:end]), self.kv_cache.round_trip(v[start:end])
        total = span.context_len + span.query_len
        table = span.block_table.unsqueeze(0)
        return (self.kv_cache.gather(0, table, dtype)[0, :, :total].transpose(0, 1),
                self.kv_cache.gather(1, table, dtype)[0, :, :total].transpose(0, 1))
