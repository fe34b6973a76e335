"""Modules that run kvik's compiled CPU kernels, swapped in for the model files' own (CPU, float32).

At decode batch sizes each chain of small PyTorch ops (a norm, the rotary embedding, SiLU gating)
costs more in dispatch and memory passes than in arithmetic; each replacement here does the same in
one kernel pass, and reuses the replaced module's parameters and submodules. Decode attention reads
the paged cache in place (no gather copy, no padding) in any of its dtypes; with AVX-512, prefill
attention computes only what the causal mask keeps, once per group of query heads.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from kvik.model.layers.attention import AttentionMetadata, PagedAttention
from kvik.model.layers.norm import RMSNorm
from kvik.model.models.llama import LlamaAttention, LlamaMLP


class FusedRMSNorm(RMSNorm):
    def __init__(self, norm: RMSNorm, kernels: Any) -> None:
        nn.Module.__init__(self)
        self.weight, self.eps, self.kernels = norm.weight, norm.eps, kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        self.kernels.rms_norm(out, x, self.weight, self.eps)
        return out

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual


class FusedLlamaAttention(nn.Module):
    """LlamaAttention without q/k norm, rotating q and k heads in one in-place pass."""

    def __init__(self, attention: LlamaAttention, kernels: Any) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = attention.num_heads, attention.num_kv_heads
        self.head_dim, self.q_size, self.kv_size = attention.head_dim, attention.q_size, attention.kv_size
        self.qkv_proj, self.o_proj, self.attn = attention.qkv_proj, attention.o_proj, attention.attn
        self.kernels = kernels

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens, dim = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)
        # q and k heads sit side by side in the projection: rotate them all in one pass.
        qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, dim)
        self.kernels.rotary_inplace(qk, *rope)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, dim)
        k = k.view(num_tokens, self.num_kv_heads, dim)
        v = v.view(num_tokens, self.num_kv_heads, dim)
        return self.o_proj(self.attn(q, k, v, meta))


class FusedLlamaMLP(nn.Module):
    def __init__(self, mlp: LlamaMLP, kernels: Any) -> None:
        super().__init__()
        self.intermediate_size = mlp.intermediate_size
        self.gate_up_proj, self.down_proj = mlp.gate_up_proj, mlp.down_proj
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        activated = gate_up.new_empty(*gate_up.shape[:-1], self.intermediate_size)
        self.kernels.silu_and_mul(activated, gate_up)
        return self.down_proj(activated)


class CpuPagedAttention(PagedAttention):
    """PagedAttention whose cache writes, decode attention and (on AVX-512, float32 or bfloat16) prefill
    attention run compiled; elsewhere prefill chunks keep PyTorch's SDPA."""

    def __init__(self, attention: PagedAttention, kernels: Any) -> None:
        super().__init__(attention.num_heads, attention.num_kv_heads, attention.head_dim, attention.scale)
        self.kv_cache = attention.kv_cache
        self.kernels = kernels
        # Twice SDPA's speed on a 512-token prompt (csrc/prefill_attention_cpu.cpp). False keeps
        # SDPA: KVIK_PREFILL_KERNEL=0 (A/B timing), or tests comparing the two.
        self.compiled_prefill = (os.environ.get("KVIK_PREFILL_KERNEL", "1") != "0"
                                 and bool(kernels.prefill_attention_supported(attention.head_dim)))

    def store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        cache = self.kv_cache
        key_scales = value_scales = None
        if cache.scales is not None:
            key_scales, value_scales = cache.scales[0], cache.scales[1]
        self.kernels.write_kv(k, cache.data[0], key_scales, slots)
        self.kernels.write_kv(v, cache.data[1], value_scales, slots)

    def attend_prefills(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                        out: torch.Tensor) -> None:
        if not self.compiled_prefill or q.dtype not in (torch.float32, torch.bfloat16):
            super().attend_prefills(q, k, v, meta, out)
            return
        for span in meta.prefills:
            start, end = span.query_start, span.query_start + span.query_len
            keys, values = self.span_keys_values(span, k, v, q.dtype)
            self.kernels.prefill_attention(q[start:end], keys, values, out[start:end], self.scale)

    def attend_decodes(self, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor) -> None:
        cache = self.kv_cache
        key_scales = value_scales = None
        if cache.scales is not None:
            key_scales, value_scales = cache.scales[0], cache.scales[1]
        # `out` is the leading rows of a contiguous tensor: the kernel writes it directly.
        self.kernels.decode_attention(q.contiguous(), cache.data[0], cache.data[1], meta.decode_block_tables,
                                      meta.decode_seq_lens, self.scale, out, key_scales, value_scales)


def swap_cpu_modules(model: nn.Module, kernels: Any) -> int:
    """Replace every module that has a compiled counterpart; returns how many were replaced. Qwen3's
    attention (RMSNorm on q and k before the rotation) keeps its own forward, with fused norms."""
    replaced = 0
    # Deepest modules first: a replacement takes over its original's children, already swapped.
    for parent in reversed(list(model.modules())):
        for name, child in list(parent.named_children()):
            swapped: nn.Module | None = None
            if type(child) is RMSNorm:
                swapped = FusedRMSNorm(child, kernels)
            elif type(child) is LlamaAttention and not child.qk_norm:
                swapped = FusedLlamaAttention(child, kernels)
            elif type(child) is LlamaMLP:
                swapped = FusedLlamaMLP(child, kernels)
            elif type(child) is PagedAttention:
                swapped = CpuPagedAttention(child, kernels)
            if swapped is not None:
                setattr(parent, name, swapped)
                replaced += 1
    return replaced
