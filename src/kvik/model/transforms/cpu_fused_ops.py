"""Switch a model's norms, rotary embedding and SiLU-gating to kvik's compiled CPU kernels.

A pass over the finished model: it sets `fused_ops` on the layers that have a fused path (RMSNorm,
the Llama family's attention and MLP). At decode batch sizes each of those chains of small PyTorch
ops costs more in dispatch and memory passes than in arithmetic.

`enable_decode_stack` goes further for steps of 1-4 decodes, where the weights stream at memory speed
and the Python between kernels is most of the rest: the compiled DecodeStack runs every decoder
layer in one call (csrc/decode_stack_cpu.cpp).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from kvik.model.models.llama import LlamaForCausalLM
from kvik.model.transforms.onednn_linear import GEMV_MAX_ROWS, OneDNNLinear

logger = logging.getLogger("kvik.model")


def enable_cpu_fused_ops(model: nn.Module, kernels: Any) -> int:
    """Give every module with a `fused_ops` slot the compiled kernels; returns how many."""
    enabled = 0
    for module in model.modules():
        if hasattr(module, "fused_ops"):
            module.fused_ops = kernels
            enabled += 1
    return enabled


def enable_decode_stack(model: nn.Module, kernels: Any) -> bool:
    """Give a Llama-family model the compiled decode stack, once its KV cache is bound. Only where
    the stack computes exactly what the modules do: RMSNorm + SiLU-gated MLP without q/k norm (not
    Qwen3), every projection on the packed small-batch GEMV, and the compiled decode attention."""
    if not isinstance(model, LlamaForCausalLM) or not hasattr(kernels, "DecodeStack"):
        return False
    cfg = model.config
    if cfg.qk_norm:
        return False
    layers = model.model.layers
    attention = layers[0].self_attn.attn
    stack = kernels.DecodeStack(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                                cfg.norm_eps, attention.scale)
    for layer in layers:
        projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                       layer.mlp.down_proj)
        specs = [p.gemv_spec() if isinstance(p, OneDNNLinear) else None for p in projections]
        paged = layer.self_attn.attn
        if any(spec is None for spec in specs) or paged.kv_cache is None or paged.decode_kernel is None:
            return False
        stack.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *specs,
                        paged.kv_cache)
    model.model.decode_stack, model.model.decode_stack_rows = stack, GEMV_MAX_ROWS
    logger.info("decode steps of 1-%d sequences run all %d layers in one compiled call",
                GEMV_MAX_ROWS, stack.num_layers)
    return True
