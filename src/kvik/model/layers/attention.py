"""Paged attention over a flat token batch, in plain PyTorch.

The KV cache of one layer is a tensor (2, num_kv_heads, num_blocks, block_size, head_dim); a token at
absolute position p of a sequence lives in slot `block_table[p // block_size] * block_size +
p % block_size` of every head. Heads come first so that gathering a sequence's blocks yields
(heads, tokens, head_dim) with the last two dimensions contiguous, which is what the CPU SDPA kernels
want (a strided layout is several times slower). Each step writes the new tokens' keys and values into their slots, then attends:

- decodes (one query token per sequence; they come first in the batch) in one batched SDPA call over
  keys gathered through the block tables, padded to the longest sequence and masked;
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
    decode_mask: torch.Tensor | None = None  # (num_decodes, 1, 1, max_blocks * block_size) bool
    decode_seq_lens: torch.Tensor | None = None  # (num_decodes,) long: tokens each decode attends
    prefills: list[PrefillSpan] = field(default_factory=list)


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.gqa = num_heads != num_kv_heads
        # Bound by the model runner after it allocates the cache; not a parameter or buffer, so it
        # never appears in state dicts.
        self.kv_cache: torch.Tensor | None = None
        # The compiled CPU decode kernel (kvik.model.layers.cpu_kernels) when the runner enables it.
        self.decode_kernel: object | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: (T, H, D); k, v: (T, Hkv, D) -> (T, H * D)."""
        assert self.kv_cache is not None, "KV cache not bound: the model runner binds it"
        num_tokens = q.shape[0]
        k_cache, v_cache = self.kv_cache[0], self.kv_cache[1]  # (Hkv, N, bs, D) each
        slots = meta.slot_mapping
        k_cache.view(self.num_kv_heads, -1, self.head_dim).index_copy_(1, slots, k.transpose(0, 1))
        v_cache.view(self.num_kv_heads, -1, self.head_dim).index_copy_(1, slots, v.transpose(0, 1))

        out = q.new_empty(num_tokens, self.num_heads, self.head_dim)
        num_decodes = meta.num_decodes
        if num_decodes and self.decode_kernel is not None:
            # A batch of decodes only (the common step) lets the kernel write the output directly.
            attended = out if num_decodes == num_tokens else q.new_empty(num_decodes, self.num_heads,
                                                                          self.head_dim)
            self.decode_kernel.decode_attention(q[:num_decodes].contiguous(), k_cache, v_cache,
                                                meta.decode_block_tables, meta.decode_seq_lens,
                                                self.scale, attended)
            if attended is not out:
                out[:num_decodes] = attended
        elif num_decodes:
            keys = self._gather(k_cache, meta.decode_block_tables)  # (B, Hkv, L, D)
            values = self._gather(v_cache, meta.decode_block_tables)
            query = q[:num_decodes].unsqueeze(2)  # (B, H, 1, D)
            attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=meta.decode_mask,
                                                      scale=self.scale, enable_gqa=self.gqa)
            out[:num_decodes] = attended.squeeze(2)
        for span in meta.prefills:
            start, end = span.query_start, span.query_start + span.query_len
            # 4-D (1, H, n, D): the 3-D form misses the fused CPU kernels.
            query = q[start:end].transpose(0, 1).unsqueeze(0)
            if span.context_len == 0:
                keys = k[start:end].transpose(0, 1).unsqueeze(0)
                values = v[start:end].transpose(0, 1).unsqueeze(0)
                attended = F.scaled_dot_product_attention(query, keys, values, is_causal=True,
                                                          scale=self.scale, enable_gqa=self.gqa)
            else:
                total = span.context_len + span.query_len
                table = span.block_table.unsqueeze(0)
                keys = self._gather(k_cache, table)[:, :, :total]
                values = self._gather(v_cache, table)[:, :, :total]
                attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=span.mask,
                                                          scale=self.scale, enable_gqa=self.gqa)
            out[start:end] = attended[0].transpose(0, 1)
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def _gather(self, cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """(Hkv, N, bs, D) cache, (B, nb) tables -> (B, Hkv, nb * bs, D), inner dims contiguous."""
        batch = block_tables.shape[0]
        gathered = cache.index_select(1, block_tables.reshape(-1))  # (Hkv, B * nb, bs, D)
        return gathered.view(self.num_kv_heads, batch, -1, self.head_dim).transpose(0, 1)
