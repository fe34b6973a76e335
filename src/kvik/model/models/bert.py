"""BERT encoders (`BertModel`, as sentence-transformers ships them, e.g. all-MiniLM-L6-v2).

Post-norm Transformer layers with bidirectional attention, learned absolute positions and token-type
embeddings (every token is type 0: one sentence per input). Parameter names mirror HF's
(`embeddings.*`, `encoder.layer.N.attention.self.query`, ...; checkpoints of `BertFor*` classes carry
a `bert.` prefix, which is dropped) with query/key/value fused into one projection.

An encoder has no KV cache: each prompt is computed whole in one step (the scheduler never chunks
it) and attends to all of its own tokens. The flat batch holds several prompts; each is one
`PrefillSpan` of the attention metadata, attended separately. The model only pools (embeddings):
it has no LM head and cannot generate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvik.model.config import ModelConfig
from kvik.model.layers.attention import AttentionMetadata
from kvik.model.pooling import MEAN
from kvik.model.weights import FusedPiece, WeightLoader


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.raw.get("type_vocab_size", 2), cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings.weight[0])


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.hidden = cfg.num_heads, cfg.head_dim, cfg.hidden_size
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv(x).view(num_tokens, 3, self.num_heads, self.head_dim).unbind(1)  # (T, H, D)
        out = torch.empty_like(q)
        for span in meta.prefills:
            start, end = span.query_start, span.query_start + span.query_len

            def heads_first(t: torch.Tensor) -> torch.Tensor:  # (n, H, D) -> (1, H, n, D)
                return t[start:end].transpose(0, 1).unsqueeze(0)

            attended = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v))
            out[start:end] = attended[0].transpose(0, 1)
        return out.reshape(num_tokens, self.hidden)


class BertSelfOutput(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)


class BertAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertSelfOutput(cfg)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.output.LayerNorm(x + self.output.dense(self.self(x, meta)))


class BertIntermediate(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)


class BertOutput(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)


class BertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertOutput(cfg)
        self.approximate = "tanh" if cfg.hidden_act in ("gelu_new", "gelu_pytorch_tanh") else "none"

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        attended = self.attention(x, meta)
        inner = F.gelu(self.intermediate.dense(attended), approximate=self.approximate)
        return self.output.LayerNorm(attended + self.output.dense(inner))


class BertEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))


class BertModel(nn.Module):
    """The encoder alone: forward returns the last hidden states (T, hidden) for pooling."""

    supported_tasks = ("embed",)
    uses_kv_cache = False
    default_pooling = MEAN
    default_normalize = False  # a bare BertModel's vectors are normalised only if modules.json says so

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.hidden_act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported for BERT")
        if cfg.raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("BERT: only absolute position embeddings are supported")
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)

    def tie_weights(self) -> None:
        """Nothing is tied in an encoder."""

    def attention_layers(self) -> list:
        return []  # no paged KV cache to bind

    def prepare(self, device: torch.device, dtype: torch.dtype) -> None:
        """No non-weight state."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            x = layer(x, meta)
        return x

    def weight_loader(self) -> WeightLoader:
        size = self.config.hidden_size
        fused = [FusedPiece("query", "qkv", 0, size), FusedPiece("key", "qkv", size, size),
                 FusedPiece("value", "qkv", 2 * size, size)]
        return WeightLoader(self, fused)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        return name.removeprefix("bert.")

    @staticmethod
    def skip_checkpoint_tensor(name: str) -> bool:
        # The pooler (a dense + tanh over [CLS]) is not part of sentence-transformers' pipeline, and
        # old checkpoints store a position_ids buffer.
        return ".pooler." in f".{name}" or name.endswith("position_ids") or name.startswith("cls.")
