"""GPT-2: learned positions, LayerNorm, fused c_attn, tanh-GELU MLP, LM head tied to the embedding.

HF stores GPT-2's projections as Conv1D with (in, out) weights; they are transposed into nn.Linear
on load. Checkpoint names come with or without the `transformer.` prefix (the original hub upload has
none), and old checkpoints carry attention-mask buffers (`attn.bias`) that are not weights.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from kvik.model.config import ModelConfig
from kvik.model.layers.attention import AttentionMetadata, PagedAttention
from kvik.model.pooling import LAST
from kvik.model.weights import WeightLoader

_CONV1D = re.compile(r"\.(c_attn|c_proj|c_fc)\.weight$")
_MASK_BUFFER = re.compile(r"\.attn\.(bias|masked_bias)$")


class GPT2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.hidden = cfg.num_heads, cfg.head_dim, cfg.hidden_size
        self.c_attn = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.c_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.attn = PagedAttention(cfg.num_heads, cfg.num_heads, cfg.head_dim, cfg.head_dim**-0.5)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.c_attn(x).split(self.hidden, dim=-1)
        shape = (num_tokens, self.num_heads, self.head_dim)
        return self.c_proj(self.attn(q.view(shape), k.view(shape), v.view(shape), meta))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.hidden_act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"activation_function {cfg.hidden_act!r} is not supported for GPT-2")
        self.approximate = "none" if cfg.hidden_act == "gelu" else "tanh"
        self.c_fc = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.c_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), meta)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.h = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x, meta)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    supported_tasks = ("generate", "embed")  # embeddings: the last token's state, normalised
    uses_kv_cache = True
    default_pooling = LAST
    default_normalize = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if cfg.raw.get(flag):
                raise ValueError(f"GPT-2 config flag {flag} is not supported")
        self.config = cfg
        self.transformer = GPT2Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        self.lm_head.weight = self.transformer.wte.weight

    def attention_layers(self) -> list[PagedAttention]:
        return [block.attn.attn for block in self.transformer.h]

    def prepare(self, device: torch.device, dtype: torch.dtype) -> None:
        """GPT-2 has no non-weight state to build."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.transformer(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def weight_loader(self) -> WeightLoader:
        def transform(name: str, tensor: torch.Tensor) -> torch.Tensor:
            return tensor.t() if _CONV1D.search(name) else tensor

        loader = WeightLoader(self, [], transform)
        loader.ignore(["lm_head.weight"])
        return loader

    def skip_checkpoint_tensor(self, name: str) -> bool:
        return bool(_MASK_BUFFER.search(name)) or name == "lm_head.weight"

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """Map a checkpoint name to this module's parameter name."""
        return name if name.startswith("transformer.") else f"transformer.{name}"
