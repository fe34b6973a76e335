"""SFT: the loss sees the assistant's tokens only, through the model's own chat template."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tests.train.helpers import CHATS, write_chat

from kvik.train.config import train_config_from_dict
from kvik.train.sft_data import IGNORE, SFTSamples, tokenize_conversation
from kvik.train.trainer import train


def _tokenizer(base_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base_model_dir)


def test_only_assistant_replies_and_their_end_of_turn_are_labelled(base_model_dir: Path) -> None:
    tokenizer = _tokenizer(base_model_dir)
    messages = CHATS[1]  # two assistant turns around a user turn
    ids, labels = tokenize_conversation(tokenizer, messages, max_tokens=1000)

    # The pieces tokenize to exactly what the template gives for the whole conversation.
    assert ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    labelled = [i for i, label in enumerate(labels) if label != IGNORE]
    assert all(labels[i] == ids[i] for i in labelled)
    # Contiguous runs of labelled tokens are exactly the replies plus "<|im_end|>\n".
    runs, run = [], []
    for i, label in enumerate(labels):
        if label != IGNORE:
            run.append(ids[i])
        elif run:
            runs.append(run)
            run = []
    if run:
        runs.append(run)
    assert [tokenizer.decode(r) for r in runs] == ["Hi.<|im_end|>\n", "Hi hi.<|im_end|>\n"]
    # Everything else -- system/user turns and the "<|im_start|>assistant\n" headers -- is masked.
    masked_text = tokenizer.decode([ids[i] for i, label in enumerate(labels) if label == IGNORE])
    assert masked_text == ("<|im_start|>user\nSay hi twice.<|im_end|>\n<|im_start|>assistant\n"
                           "<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n")


def test_batches_are_shifted_and_padded_without_loss_on_padding(base_model_dir: Path) -> None:
    tokenizer = _tokenizer(base_model_dir)
    samples = SFTSamples(tokenizer, CHATS, seq_len=64, seed=0)
    batch = samples.batch(range(3))
    assert batch.input_ids.shape == batch.labels.shape == batch.attention_mask.shape
    for row in range(3):
        length = int(batch.attention_mask[row].sum())
        assert (batch.labels[row, length:] == IGNORE).all()
        # labels[t] is the token after input t wherever it is labelled.
        ids = batch.input_ids[row, :length].tolist()
        for t in range(length - 1):
            if batch.labels[row, t] != IGNORE:
                assert batch.labels[row, t] == ids[t + 1]
    assert batch.num_label_tokens == sum(
        sum(label != IGNORE for label in tokenize_conversation(tokenizer, m, 65)[1][1:]) for m in CHATS)


def test_sft_run_writes_a_model_that_learnt_the_replies(base_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    chats = write_chat(tmp_path / "chat.jsonl", CHATS)
    config = train_config_from_dict({
        "output_dir": str(tmp_path / "sft"), "task": "sft",
        "model": {"init_from": str(base_model_dir)},
        "data": {"sft_path": str(chats), "seq_len": 64}, "max_steps": 25, "micro_batch_size": 3,
        "optim": {"lr": 3e-3, "warmup_steps": 2}, "tensorboard": False,
        "checkpoint": {"every_steps": 0}})
    result = train(config)
    assert result.finished and result.last_loss < result.first_loss / 3
    tokenizer = _tokenizer(tmp_path / "sft")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "sft")
    prompt = tokenizer.apply_chat_template(CHATS[0][:2], add_generation_prompt=True, tokenize=True,
                                           return_dict=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert tokenizer.decode(out[0, prompt["input_ids"].shape[1]:]).startswith("Paris.")
    assert json.loads((tmp_path / "sft" / "generation_config.json").read_text())["eos_token_id"][-1] == \
        tokenizer.convert_tokens_to_ids("<|im_end|>")
