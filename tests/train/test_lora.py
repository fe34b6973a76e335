"""LoRA: kvik train saves a standard PEFT adapter that PEFT loads, and --merge writes a plain model
that computes the same function."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tests.train.helpers import CHATS, write_chat

from kvik.cli.main import main


def test_lora_adapter_loads_in_peft_and_merges(base_model_dir: Path, tmp_path: Path, capsys) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    chats = write_chat(tmp_path / "chat.jsonl", CHATS)
    out = tmp_path / "adapter"
    (tmp_path / "lora.yaml").write_text(json.dumps({
        "output_dir": str(out), "task": "sft", "model": {"init_from": str(base_model_dir)},
        "data": {"sft_path": str(chats), "seq_len": 64}, "max_steps": 6, "micro_batch_size": 3,
        "optim": {"lr": "1e-2", "warmup_steps": 1}, "tensorboard": False,
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}}))
    assert main(["train", "--config", str(tmp_path / "lora.yaml"), "--merge"]) == 0
    assert "finished at step 6" in capsys.readouterr().out

    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {
        p.name for p in out.iterdir()}
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["r"] == 4 and set(adapter_config["target_modules"]) == {"q_proj", "v_proj"}
    assert Path(adapter_config["base_model_name_or_path"]) == base_model_dir.resolve()

    base = AutoModelForCausalLM.from_pretrained(base_model_dir)
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        base_logits = base(ids).logits
        peft_model = PeftModel.from_pretrained(base, out)
        adapted = peft_model(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out / "merged")(ids).logits
    assert not torch.allclose(adapted, base_logits, atol=1e-4)  # the adapter was trained
    torch.testing.assert_close(merged, adapted, atol=1e-4, rtol=1e-4)
    # The checkpoints hold the trainable (adapter) weights only.
    checkpoint = torch.load(next((out / "checkpoints").iterdir()) / "model.pt", weights_only=True)
    assert checkpoint and all("lora_" in key for key in checkpoint)
