"""Tiny LoRA adapters for tests, and HF + PEFT (adapter merged) as the reference."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Short chats for `kvik train` SFT adapters; each adapter gets its own so they differ.
CHAT_TOPICS = ["the sea", "mountains", "bread", "trains", "owls", "rain", "chess", "tea"]


def write_random_adapter(base_dir: Path, out: Path, *, seed: int, r: int = 4, alpha: int = 8,
                         targets: list[str] | None = None, use_rslora: bool = False) -> Path:
    """A PEFT adapter with random non-zero A and B, written by PEFT's own save_pretrained."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_TARGETS,
                                            init_lora_weights=False, use_rslora=use_rslora,
                                            task_type="CAUSAL_LM"))
    with torch.no_grad():  # big enough to change greedy tokens of the tiny model
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(out)
    return out


def train_adapter(base_dir: Path, out: Path, work: Path, *, topic: str, targets: list[str], r: int = 4,
                  steps: int = 4) -> Path:
    """An SFT adapter trained by `kvik train` (a few steps at a high learning rate, so it matters)."""
    from kvik.cli.main import main

    chats = work / f"chat-{topic.replace(' ', '_')}.jsonl"
    with chats.open("w") as handle:
        for i in range(6):
            handle.write(json.dumps({"messages": [
                {"role": "user", "content": f"Tell me about {topic} ({i})."},
                {"role": "assistant", "content": f"{topic} {topic} is what I think of, {i} times over."}]}) + "\n")
    config = work / f"lora-{out.name}.yaml"
    config.write_text(json.dumps({
        "output_dir": str(out), "task": "sft", "model": {"init_from": str(base_dir)},
        "data": {"sft_path": str(chats), "seq_len": 48}, "max_steps": steps, "micro_batch_size": 3,
        "optim": {"lr": "5e-2", "warmup_steps": 1}, "tensorboard": False,
        "checkpoint": {"every_steps": 0},
        "lora": {"r": r, "alpha": 2 * r, "target_modules": targets}}))
    assert main(["train", "--config", str(config)]) == 0
    return out


@lru_cache(maxsize=16)
def merged_model(base_dir: Path, adapter_dir: Path | None):
    """HF model with the adapter merged by PEFT (merge_and_unload), or the plain base model."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is None:
        return base.eval()
    from peft import PeftModel

    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


@torch.no_grad()
def reference_greedy(base_dir: Path, adapter_dir: Path | None, prompt_ids: list[int], max_new_tokens: int
                     ) -> list[int]:
    model = merged_model(base_dir, adapter_dir)
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
