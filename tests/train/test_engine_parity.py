"""What kvik train writes is what kvik serves: the engine loads the directory, and its greedy
tokens equal HF transformers' on the same weights."""

from __future__ import annotations

from pathlib import Path

import torch
from tests.train.helpers import pretrain_config

from kvik.train.config import train_config_from_dict
from kvik.train.trainer import train

PROMPTS = ["MACBETH\n", "First Witch\nWhen shall we three meet again", "The king"]


def test_trained_model_greedy_output_in_kvik_equals_transformers(shards_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvik import LLM, SamplingParams

    out = tmp_path / "model"
    train(train_config_from_dict(pretrain_config(out, shards_dir, max_steps=30)))

    tokenizer = AutoTokenizer.from_pretrained(out)
    reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    llm = LLM(model=str(out), device="cpu", dtype="float32")
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    for prompt, output in zip(PROMPTS, outputs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            expected = reference.generate(ids, max_new_tokens=8, do_sample=False,
                                          pad_token_id=tokenizer.eos_token_id)[0, ids.shape[1]:]
        assert list(output.outputs[0].token_ids) == expected.tolist(), prompt
