"""Supervised fine-tuning samples from chat JSONL, with loss on the assistant's tokens only.

A conversation is rendered with the model's own chat template, one message at a time: the text each
message adds is tokenized on its own and labelled trainable only when it is an assistant reply
(its content and end-of-turn marker, not the "<|im_start|>assistant" header that the server's
prompt already contains). Rendering prefixes of the conversation needs no special template markup
(no `{% generation %}` blocks), only that the template renders a prefix of the messages as a prefix
of the text, which chat templates do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvik.core.errors import ConfigError
from kvik.core.jsonl import jsonl_values
from kvik.train.batches import Batch, EpochShuffle

IGNORE = -100


def render_segments(tokenizer: Any, messages: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    """(text, trainable) pieces whose concatenation is the rendered conversation."""
    segments: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message.get("role") == "assistant":
            header = tokenizer.apply_chat_template(messages[:i], tokenize=False,
                                                   add_generation_prompt=True)
            if not header.startswith(done):
                raise ConfigError("the chat template does not render a prefix of a conversation as "
                                  "a prefix of its text; cannot find the assistant's tokens")
            segments.append((header[len(done):], False))
            done = header
        text = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
        if not text.startswith(done):
            raise ConfigError("the chat template does not render a prefix of a conversation as a "
                              "prefix of its text; cannot find the assistant's tokens")
        segments.append((text[len(done):], message.get("role") == "assistant"))
        done = text
    return [(text, trainable) for text, trainable in segments if text]


def tokenize_conversation(tokenizer: Any, messages: list[dict[str, Any]],
                          max_tokens: int) -> tuple[list[int], list[int]]:
    """(token ids, labels) of one conversation, at most `max_tokens`; labels are the ids on
    assistant tokens and IGNORE elsewhere (not yet shifted)."""
    ids: list[int] = []
    labels: list[int] = []
    for text, trainable in render_segments(tokenizer, messages):
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if trainable else [IGNORE] * len(piece)
    return ids[:max_tokens], labels[:max_tokens]


def read_conversations(path: str | Path) -> list[list[dict[str, Any]]]:
    conversations = []
    for number, record in jsonl_values(path):
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list) or not messages:
            raise ConfigError(f'{path}:{number}: expected {{"messages": [{{"role", "content"}}, ...]}}')
        conversations.append(messages)
    return conversations


class SFTSamples:
    """Tokenized conversations; batches are right-padded to their longest sample."""

    def __init__(self, tokenizer: Any, conversations: list[list[dict[str, Any]]], seq_len: int,
                 seed: int) -> None:
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
            else tokenizer.eos_token_id
        self._samples = []
        for messages in conversations:
            ids, labels = tokenize_conversation(tokenizer, messages, seq_len + 1)
            # Shift here: position t predicts token t + 1.
            if any(label != IGNORE for label in labels[1:]):
                self._samples.append((ids[:-1], labels[1:]))
        if not self._samples:
            raise ConfigError("data.sft_path: no conversation has an assistant reply within "
                              "data.seq_len tokens")
        self.skipped = len(conversations) - len(self._samples)
        self._order = EpochShuffle(len(self._samples), seed)

    def __len__(self) -> int:
        return len(self._samples)

    def batch(self, samples: range) -> Batch:
        rows = [self._samples[self._order(sample)] for sample in samples]
        return Batch(*pad_rows(rows, self._pad_id))


def pad_rows(rows: list[tuple[list[int], list[int]]], pad_id: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids, labels) rows right-padded to the longest: input ids (pad_id), labels (IGNORE) and
    the attention mask, each (rows, longest) int64."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, (ids, row_labels) in enumerate(rows):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        labels[row, :len(ids)] = torch.tensor(row_labels)
        mask[row, :len(ids)] = 1
    return input_ids, labels, mask
