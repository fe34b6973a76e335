"""Writing the result: an HF model directory `kvik serve` loads, or a PEFT adapter directory
(adapter_config.json, adapter_model.safetensors) and optionally the merged model.

Rank 0 rebuilds the model unwrapped on the CPU and loads the full trained state into it, so one path
serves a single process, DDP and FSDP alike (an FSDP module holds only a shard of each weight).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from kvik.train.config import TrainConfig
from kvik.train.model_setup import TOKENIZER_FILES, build_model, generation_eos_ids


def copy_tokenizer(source: Path, out_dir: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copyfile(source / name, out_dir / name)


def _write_generation_config(out_dir: Path, tokenizer: Any) -> None:
    path = out_dir / "generation_config.json"
    settings = json.loads(path.read_text()) if path.exists() else {}
    settings["eos_token_id"] = generation_eos_ids(tokenizer)
    path.write_text(json.dumps(settings, indent=2) + "\n")


def _save_full(model: torch.nn.Module, out_dir: Path, tokenizer: Any, tokenizer_dir: Path) -> None:
    model.save_pretrained(out_dir, safe_serialization=True)
    copy_tokenizer(tokenizer_dir, out_dir)
    _write_generation_config(out_dir, tokenizer)


def export(config: TrainConfig, full_state: dict[str, torch.Tensor], tokenizer: Any,
           tokenizer_dir: Path) -> list[Path]:
    """Write the trained model (or adapter, and merged model) from its full state dict; returns
    the directories written. Weights are saved in fp32, the dtype they were trained in."""
    out_dir = Path(config.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(config, tokenizer)
    # The state holds every tensor the model had in training: strict catches any mismatch.
    model.load_state_dict(full_state, strict=True)
    if config.lora is None:
        _save_full(model, out_dir, tokenizer, tokenizer_dir)
        return [out_dir]
    # PEFT records the base as given; an absolute path keeps the adapter loadable from anywhere.
    model.peft_config["default"].base_model_name_or_path = str(Path(config.model.init_from).resolve())
    model.save_pretrained(out_dir)
    copy_tokenizer(tokenizer_dir, out_dir)
    written = [out_dir]
    if config.lora.merge:
        merged_dir = Path(config.lora.merged_dir or out_dir / "merged")
        merged_dir.mkdir(parents=True, exist_ok=True)
        _save_full(model.merge_and_unload(), merged_dir, tokenizer, tokenizer_dir)
        written.append(merged_dir)
    return written
