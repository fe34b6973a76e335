"""Train-config builders sized for two CPU cores, and a few chat conversations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# hidden 64, 2 layers: a step of 8 x 64 tokens takes milliseconds.
TINY_MODEL = {"type": "llama", "config": {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "max_position_embeddings": 256}}


def pretrain_config(out: Path, shards: Path, **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "output_dir": str(out), "task": "pretrain", "model": TINY_MODEL,
        "data": {"shards": str(shards), "seq_len": 64}, "max_steps": 12, "micro_batch_size": 8,
        "optim": {"lr": 3e-3, "warmup_steps": 3}, "checkpoint": {"every_steps": 4, "keep_last": 2},
        "tensorboard": False, "eval_batches": 2,
    }
    config.update(overrides)
    return config


def write_chat(path: Path, conversations: list[list[dict[str, str]]]) -> Path:
    import json

    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    return path


CHATS = [
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "Paris."}],
    [{"role": "user", "content": "Say hi twice."},
     {"role": "assistant", "content": "Hi."},
     {"role": "user", "content": "Again."},
     {"role": "assistant", "content": "Hi hi."}],
    [{"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "Four."}],
]


def train_losses(out: Path) -> list[float]:
    """The training loss of every step, from the run's metrics.jsonl."""
    import json

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]
