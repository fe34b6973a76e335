"""Pooling: one vector per prompt from the model's final hidden states.

How a model pools is read the way sentence-transformers configures it: `modules.json` lists the
pipeline (Transformer, then Pooling with its `1_Pooling/config.json`, then optionally Normalize), and
`sentence_bert_config.json` the longest input it was trained on. Without those files the model's
class decides: an encoder (BERT) mean-pools, a decoder takes its last token; an embedding from a
decoder is normalised, a classifier's pooled state goes through its score head unnormalised.

Matryoshka support is declared in config.json (`matryoshka_dimensions: [...]` or
`is_matryoshka: true`); only then may a request ask for fewer `dimensions` (the leading values,
renormalised).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from kvik.core.errors import ConfigError
from kvik.model.config import ModelConfig

logger = logging.getLogger("kvik.model")

MEAN, CLS, LAST = "mean", "cls", "last"

# sentence-transformers modules kvik implements; anything else (Dense, LayerNorm, ...) changes the
# vectors, so a model that uses one is refused rather than served wrong.
_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(slots=True)
class PoolingConfig:
    method: str  # MEAN | CLS | LAST
    normalize: bool
    hidden_size: int
    max_seq_length: int | None = None  # sentence_bert_config.json: the longest input it was trained on
    matryoshka: bool = False
    matryoshka_dimensions: list[int] = field(default_factory=list)


def load_pooling_config(path: Path, cfg: ModelConfig, default_method: str,
                        default_normalize: bool) -> PoolingConfig:
    """The model's pooling from its sentence-transformers files, else the class defaults."""
    raw = cfg.raw
    dims = raw.get("matryoshka_dimensions") or []
    config = PoolingConfig(default_method, default_normalize, cfg.hidden_size,
                           matryoshka=bool(raw.get("is_matryoshka") or dims),
                           matryoshka_dimensions=sorted(int(d) for d in dims))
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return config
    try:
        modules = json.loads(modules_file.read_text())
        config.normalize = False  # sentence-transformers normalises only with a Normalize module
        for module in modules:
            kind = module.get("type", "")
            if kind == _POOLING:
                _read_pooling(path / module.get("path", ""), config)
            elif kind == _NORMALIZE:
                config.normalize = True
            elif kind != _TRANSFORMER:
                raise ConfigError(f"{modules_file}: module {kind!r} is not supported; kvik applies "
                                  "Transformer, Pooling and Normalize only")
        bert_config = path / "sentence_bert_config.json"
        if bert_config.is_file():
            config.max_seq_length = json.loads(bert_config.read_text()).get("max_seq_length")
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError(f"{modules_file}: could not read the sentence-transformers pipeline ({exc})")
    return config


def _read_pooling(directory: Path, config: PoolingConfig) -> None:
    settings = json.loads((directory / "config.json").read_text())
    modes = [name for name, on in (("cls", settings.get("pooling_mode_cls_token")),
                                   ("mean", settings.get("pooling_mode_mean_tokens")),
                                   ("last", settings.get("pooling_mode_lasttoken")),
                                   ("max", settings.get("pooling_mode_max_tokens")),
                                   ("mean_sqrt_len", settings.get("pooling_mode_mean_sqrt_len_tokens")),
                                   ("weightedmean", settings.get("pooling_mode_weightedmean_tokens")))
             if on]
    if len(modes) != 1 or modes[0] not in (MEAN, CLS, LAST):
        raise ConfigError(f"{directory}/config.json: pooling {modes or 'none'} is not supported; kvik "
                          "pools by exactly one of mean, cls or last token")
    if settings.get("include_prompt") is False:
        raise ConfigError(f"{directory}/config.json: include_prompt=false is not supported")
    dimension = settings.get("word_embedding_dimension")
    if dimension is not None and dimension != config.hidden_size:
        raise ConfigError(f"{directory}/config.json: word_embedding_dimension {dimension} differs from "
                          f"the model's hidden size {config.hidden_size}")
    config.method = modes[0]


@dataclass(slots=True)
class PoolSpan:
    """The rows of one prompt in the flat batch of hidden states."""

    start: int
    length: int


def pool(hidden: torch.Tensor, spans: list[PoolSpan], method: str) -> torch.Tensor:
    """(T, H) hidden states -> (B, H) float32, one row per span. MEAN and CLS need the span to hold
    the whole prompt (the scheduler runs such prompts unchunked); LAST needs only its last row."""
    if method == LAST:
        rows = torch.tensor([s.start + s.length - 1 for s in spans], device=hidden.device)
        return hidden.index_select(0, rows).float()
    if method == CLS:
        rows = torch.tensor([s.start for s in spans], device=hidden.device)
        return hidden.index_select(0, rows).float()
    return torch.stack([hidden[s.start:s.start + s.length].float().mean(dim=0) for s in spans])


def finish_embeddings(pooled: torch.Tensor, dimensions: list[int | None], normalize: bool) -> list[torch.Tensor]:
    """Truncate each row to its requested dimensions (Matryoshka), then L2-normalise if the model
    does. Returns one 1-D float32 tensor per row."""
    out = []
    for row, size in zip(pooled, dimensions):
        if size is not None:
            row = row[:size]
        if normalize:
            row = F.normalize(row, p=2.0, dim=0)
        out.append(row)
    return out


def num_labels(cfg: ModelConfig) -> int:
    """HF's rule: `id2label` decides, else `num_labels`, else 2."""
    labels = cfg.raw.get("id2label")
    if labels:
        return len(labels)
    return int(cfg.raw.get("num_labels", 2))


def label_names(cfg: ModelConfig) -> list[str]:
    labels = cfg.raw.get("id2label") or {}
    count = num_labels(cfg)
    return [str(labels.get(str(i), labels.get(i, f"LABEL_{i}"))) for i in range(count)]
