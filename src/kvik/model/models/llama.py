"""The Llama family: Llama (GQA, Llama-3 rope scaling), Mistral, Qwen2 (bias on q/k/v) and Qwen3
(RMSNorm on q and k per head). They differ only in flags of `ModelConfig`, so one implementation
serves all four and each keeps the HF parameter names (with q/k/v and gate/up fused).

Forward contract shared by every kvik model: `forward(input_ids (T,), positions (T,), meta)` returns
hidden states (T, hidden) for a flat batch of tokens from many sequences; `compute_logits(hidden)`
applies the LM head to the rows that need logits only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvik.model.config import ModelConfig
from kvik.model.layers.attention import AttentionMetadata, PagedAttention
from kvik.model.layers.norm import RMSNorm
from kvik.model.layers.rotary import RotaryEmbedding, apply_rotary, rotate
from kvik.model.pooling import LAST, num_labels
from kvik.model.weights import FusedPiece, WeightLoader


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.kv_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        # Qwen2 has biases on q/k/v but not on the output projection; Llama's flag covers both.
        o_bias = cfg.attention_bias and cfg.model_type != "qwen2"
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.qk_norm = cfg.qk_norm
        self.attn = PagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens, heads, kv_heads, dim = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        cos, sin = rope  # (T, D) each
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, kv_heads, dim)
        if self.qk_norm:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(num_tokens, heads, dim))
            k = self.k_norm(k.view(num_tokens, kv_heads, dim))
            q, k = apply_rotary(q, k, cos.unsqueeze(1), sin.unsqueeze(1))
        else:
            # q and k lie side by side in the fused projection: rotated as one tensor, the same
            # arithmetic in half the kernel launches (what a GPU decode step is bound by).
            qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, heads + kv_heads, dim)
            q, k = rotate(qk, cos.unsqueeze(1), sin.unsqueeze(1)).split([heads, kv_heads], dim=1)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported for {cfg.architecture}")
        bias = bool(cfg.raw.get("mlp_bias", False))
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                residual: torch.Tensor | None, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (not yet added); residual: the stream before it (None for
        the first layer). Returns both, so the next norm can fuse the addition."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.forward_residual(x, residual)
        x = self.self_attn(rope, x, meta)
        x, residual = self.post_attention_layernorm.forward_residual(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.rotary = [rotary]  # a list: the module is owned by LlamaForCausalLM
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary[0].tables(positions)
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual, meta)
        return self.norm.forward_residual(x, residual)[0]


class LlamaTrunk(nn.Module):
    """What the Llama family's task models share: the rotary tables and the decoder body
    (`self.model`); `forward` returns the final hidden states and each subclass adds its head."""

    uses_kv_cache = True
    default_pooling = LAST

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling)
        self.model = LlamaModel(cfg, self.rotary)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def prepare(self, device: torch.device, dtype: torch.dtype) -> None:
        """Build non-weight state after the weights are loaded (rotary tables)."""
        self.rotary.build_cache(device, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        return name


class LlamaForCausalLM(LlamaTrunk):
    # A decoder also embeds: the last token's final hidden state, normalised (unless the model's
    # sentence-transformers files say otherwise).
    supported_tasks = ("generate", "embed")
    default_normalize = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so (again after
        materialising from the meta device, which unties parameters)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def weight_loader(self) -> WeightLoader:
        cfg = self.config
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.kv_dim, cfg.intermediate_size
        fused = [
            FusedPiece("q_proj", "qkv_proj", 0, q),
            FusedPiece("k_proj", "qkv_proj", q, kv),
            FusedPiece("v_proj", "qkv_proj", q + kv, kv),
            FusedPiece("gate_proj", "gate_up_proj", 0, inter),
            FusedPiece("up_proj", "gate_up_proj", inter, inter),
        ]
        loader = WeightLoader(self, fused)
        if cfg.tie_word_embeddings:
            loader.ignore(["lm_head.weight"])
        return loader

    def skip_checkpoint_tensor(self, name: str) -> bool:
        # Old checkpoints store rotary tables; tied models may still ship an lm_head copy, which HF
        # ignores in favour of the embedding.
        return name.endswith("rotary_emb.inv_freq") or (
            self.config.tie_word_embeddings and name == "lm_head.weight")


class LlamaForSequenceClassification(LlamaTrunk):
    """The Llama family with a score head instead of the LM head (HF's `*ForSequenceClassification`;
    a reward model is one with a single label). The last token's final hidden state goes through
    `score` (no bias); HF takes the last token that is not the pad token, which the engine matches
    by dropping trailing pad tokens from the prompt (a causal model's earlier states do not depend
    on them)."""

    supported_tasks = ("classify",)
    default_normalize = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.score = nn.Linear(cfg.hidden_size, num_labels(cfg), bias=False)

    def tie_weights(self) -> None:
        """The score head is never tied."""

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """(B, hidden) pooled states -> (B, num_labels) logits."""
        # The embedding's dtype is the model's (the score head may be repacked for oneDNN).
        return self.score(pooled.to(self.model.embed_tokens.weight.dtype))

    def weight_loader(self) -> WeightLoader:
        return LlamaForCausalLM.weight_loader(self)  # the same fused projections

    def skip_checkpoint_tensor(self, name: str) -> bool:
        return name.endswith("rotary_emb.inv_freq")

