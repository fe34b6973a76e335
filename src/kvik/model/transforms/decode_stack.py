"""The compiled decode stack as a wrapper module: steps of 1-8 decodes run every layer in one call.

Such steps stream the weights at memory speed, and the Python between the layers' kernels is most of
the rest (csrc/decode_stack_cpu.cpp). The wrapper takes the place of a Llama-family model's
LlamaModel and hands every other step to it unchanged; the stack chains the same kernels the swapped
modules call, so both paths compute the same outputs.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
from torch import nn

from kvik.model.layers.attention import AttentionMetadata
from kvik.model.layers.cpu_kernels import cpu_kernels
from kvik.model.models.llama import LlamaForCausalLM, LlamaModel
from kvik.model.transforms.cpu_modules import CpuPagedAttention, FusedLlamaAttention, FusedLlamaMLP
from kvik.model.transforms.onednn_linear import GEMV_MAX_ROWS
from kvik.model.transforms.screened_head import ScreenedHead, screen_for

logger = logging.getLogger("kvik.model")

# The stack's projections run the small-batch kernels; GEMV_MAX_ROWS is where they stop paying.
DECODE_STACK_MAX_ROWS = GEMV_MAX_ROWS


class DecodeStackModel(nn.Module):
    """Wraps a LlamaModel; `decode_stack` is the compiled stack of all its layers."""

    def __init__(self, inner: LlamaModel, decode_stack: Any, max_rows: int = DECODE_STACK_MAX_ROWS,
                 lora_context: Any = None) -> None:
        super().__init__()
        # The body's children are adopted under their own names, so parameter names stay LlamaModel's
        # (weight sync and state_dict address `model.layers.0...`); the body itself is held outside
        # the module tree for the steps the stack does not take.
        for name, child in inner.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "inner", inner)
        self.decode_stack = decode_stack
        self.decode_stack_rows = max_rows
        # With LoRA serving (kvik.model.lora): the stack runs base weights only, so a step in which
        # any token uses an adapter takes the modules' path, which adds the adapters.
        self.lora_context = lora_context

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        lora = self.lora_context
        if not meta.num_decodes == input_ids.shape[0] <= self.decode_stack_rows or (lora is not None and lora.active):
            return self.inner(input_ids, positions, meta)
        inner = self.inner
        rotary, norm = inner.rotary[0], inner.norm
        # The embedding lookup, the rotary tables' rows and the final norm run in the same call as
        # the layers (what LlamaModel.forward does around them).
        return self.decode_stack.forward_tokens(input_ids, positions, inner.embed_tokens.weight, rotary.cos,
                                                rotary.sin, norm.weight, norm.eps, meta.slot_mapping,
                                                meta.decode_block_tables, meta.decode_seq_lens)

    def greedy_steps(self, head: Any, token_ids: torch.Tensor, start_positions: torch.Tensor,
                     block_tables: torch.Tensor, block_size: int, steps: int, stop_ids: torch.Tensor,
                     live: torch.Tensor) -> torch.Tensor:
        """`steps` greedy forwards in one call, each feeding the next the tokens it chose (the
        stack's greedy_steps: the body, `head` - greedy_head's answer, the LM head and its int8
        copy - and the argmax); (forwards run, T) token ids."""
        inner = self.inner
        rotary, norm = inner.rotary[0], inner.norm
        screen = head.screen
        return self.decode_stack.greedy_steps(token_ids, start_positions, block_tables, block_size, steps, stop_ids,
                                              live, inner.embed_tokens.weight, rotary.cos, rotary.sin, norm.weight,
                                              norm.eps, head.weight, None if screen is None else screen.coarse,
                                              None if screen is None else screen.bound)


class GreedyHead(NamedTuple):
    weight: Any  # the LM head's compiled weight
    screen: ScreenedHead | None  # its int8 copy and bound (a bfloat16 or packed float32 head), or None


def greedy_head(model: nn.Module) -> GreedyHead | None:
    """The LM head's compiled weight (and int8 copy: kvik.model.transforms.screened_head), for
    DecodeStackModel.greedy_steps, where a model's logits are that head's output (a Llama-family
    model wrapped in the decode stack, compute_logits not overridden); else None. The copy is made
    once per head and kept on it."""
    if not (isinstance(model, LlamaForCausalLM) and isinstance(model.model, DecodeStackModel)
            and type(model).compute_logits is LlamaForCausalLM.compute_logits):
        return None
    head = model.lm_head
    kernel_weight = getattr(head, "kernel_weight", None)
    weight = kernel_weight() if kernel_weight is not None else None
    if weight is None:
        return None
    return GreedyHead(weight, screen_for(head, cpu_kernels()))


def unwrap_decode_stack(model: nn.Module) -> None:
    """Put the plain LlamaModel back (before binding a new cache)."""
    if isinstance(model, LlamaForCausalLM) and isinstance(model.model, DecodeStackModel):
        model.model = model.model.inner


def wrap_decode_stack(model: nn.Module) -> bool:
    """Wrap a Llama-family model's body in a DecodeStackModel, once its KV cache is bound. Only where
    the stack computes exactly what the modules do: the swapped attention (no q/k norm, so not
    Qwen3) and MLP, every projection on a small-batch kernel, the compiled decode attention."""
    if not isinstance(model, LlamaForCausalLM):
        return False
    body = model.model.inner if isinstance(model.model, DecodeStackModel) else model.model
    cfg = model.config
    layers = body.layers
    embedding = body.embed_tokens  # looked up inside the stack's call: a plain float32 table only
    if type(embedding) is not nn.Embedding or embedding.weight.dtype != torch.float32 or embedding.max_norm:
        return False
    first = layers[0]
    if not isinstance(first.self_attn, FusedLlamaAttention) or not isinstance(first.self_attn.attn,
                                                                              CpuPagedAttention):
        return False
    kernels = first.self_attn.attn.kernels
    if not hasattr(kernels, "DecodeStack"):
        return False
    stack = kernels.DecodeStack(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                                cfg.norm_eps, first.self_attn.attn.scale)
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        if not (isinstance(attention, FusedLlamaAttention) and isinstance(mlp, FusedLlamaMLP)
                and isinstance(attention.attn, CpuPagedAttention) and attention.attn.kv_cache is not None):
            return False
        projections = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        weights = [getattr(p, "kernel_weight", lambda: None)() for p in projections]
        if any(w is None for w in weights):
            return False
        cache = attention.attn.kv_cache
        stack.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *weights,
                        cache.data, cache.scales)
    lora_context = getattr(first.self_attn.qkv_proj, "lora_context", None)
    model.model = DecodeStackModel(body, stack, lora_context=lora_context)
    logger.info("decode steps of 1-%d sequences run all %d layers in one compiled call",
                DECODE_STACK_MAX_ROWS, stack.num_layers)
    return True
