"""The model and tokenizer a run trains: a fresh HF model from a config, or an existing directory,
optionally wrapped with a LoRA adapter (PEFT)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from kvik.core.errors import ConfigError
from kvik.train.config import TrainConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# ChatML's end of turn: generation must stop there too, as the tokenizer files of kvik list it.
END_OF_TURN = "<|im_end|>"


def check_tokenizer_matches(init_from: Path, data_tokenizer_dir: Path) -> None:
    """Continued pretraining: the shards' token ids must mean what the model's tokenizer says."""
    model_file = init_from / "tokenizer.json"
    if not model_file.exists():
        return
    ours = hashlib.sha256((data_tokenizer_dir / "tokenizer.json").read_bytes()).digest()
    if hashlib.sha256(model_file.read_bytes()).digest() != ours:
        raise ConfigError(f"model.init_from: {init_from}'s tokenizer differs from the one the shards "
                          "were tokenized with; tokenize the data with --tokenizer pointing at the "
                          "model directory")


def load_tokenizer(directory: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def build_model(config: TrainConfig, tokenizer: Any) -> torch.nn.Module:
    """The trainable module in fp32 on the CPU (moved and wrapped by the caller). Uses the global
    torch RNG for fresh weights, so seed it first: every rank then builds the same model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if config.model.init_from:
        model = AutoModelForCausalLM.from_pretrained(config.model.init_from, dtype=torch.float32)
    else:
        settings = {
            "vocab_size": len(tokenizer),
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            **config.model.config,
        }
        try:
            hf_config = AutoConfig.for_model(config.model.type, **settings)
        except ValueError as exc:
            raise ConfigError(f"model.type: {exc}") from exc
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    if config.lora is not None:
        from peft import LoraConfig, get_peft_model

        lora = config.lora
        model = get_peft_model(model, LoraConfig(
            r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules), task_type="CAUSAL_LM"))
    return model


def generation_eos_ids(tokenizer: Any) -> list[int]:
    """End-of-text and, for chat models, end-of-turn: the ids generation stops on."""
    ids = [tokenizer.eos_token_id]
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id and end_of_turn not in ids:
        ids.append(end_of_turn)
    return [i for i in ids if i is not None]
