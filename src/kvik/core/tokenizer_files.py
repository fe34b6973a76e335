"""Byte-level BPE tokenizers trained locally and written in HF format (tokenizer.json +
tokenizer_config.json with a ChatML chat template).

Used by `kvik make-model` for random-weight test models and by the data pipeline for tokenizers
trained on its corpus. Needs only the `tokenizers` package: no torch, no download.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML: the format Qwen ships; generation stops on <|im_end|> (listed in generation_config).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(vocab_size: int, corpus: list[str] | None = None) -> Any:
    """A byte-level BPE (GPT-2 style) trained on kvik's small built-in corpus, deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if corpus is None:
        text = resources.files("kvik.core").joinpath("assets/corpus.txt").read_text("utf-8")
        corpus = text.splitlines()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


def write_tokenizer(out_dir: Path, tokenizer: Any, model_max_length: int) -> dict[str, int]:
    """Write tokenizer.json + tokenizer_config.json; return the special token ids."""
    tokenizer.save(str(out_dir / "tokenizer.json"))
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    added = {
        str(ids[tok]): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True}
        for tok in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"eos": ids["<|endoftext|>"], "im_end": ids["<|im_end|>"], "im_start": ids["<|im_start|>"]}
