"""Comparisons as training pairs: (prompt, chosen response, rejected response), tokenized.

A prompt and a response are rendered the way the server will see them: with the model's chat
template as a user turn and an assistant reply (`kvik.train.sft_data.render_segments`, so the
response's tokens are exactly the assistant's), or, for a model without a template, as the prompt
text followed by the response text. The same encoding serves the reward model (a score read at the
last token) and DPO (log-likelihood of the response tokens), and `encode_prompt` gives the token
ids that PPO's rollouts continue.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from kvik.core.comparisons import Comparison, load_comparison_splits
from kvik.core.errors import ConfigError
from kvik.train.batches import EpochShuffle
from kvik.train.config import TrainConfig
from kvik.train.model_setup import load_tokenizer
from kvik.train.sft_data import IGNORE, pad_rows, render_segments
from kvik.train.task import SupervisedTask


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """The tokens a response continues: the chat prompt with the assistant header, or the text."""
    if has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def encode_response(tokenizer: Any, prompt: str, response: str) -> tuple[list[int], list[bool]]:
    """(token ids, is-response flag per token) of a prompt and its response."""
    if has_chat_template(tokenizer):
        ids: list[int] = []
        flags: list[bool] = []
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        for text, trainable in render_segments(tokenizer, messages):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            flags += [trainable] * len(piece)
        return ids, flags
    prompt_ids = tokenizer(prompt)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    return prompt_ids + response_ids, [False] * len(prompt_ids) + [True] * len(response_ids)


@dataclass(frozen=True, slots=True)
class EncodedPair:
    chosen: list[int]
    chosen_labels: list[int]  # the next token where it is a response token, else IGNORE
    rejected: list[int]
    rejected_labels: list[int]


def _shifted(ids: list[int], flags: list[bool], max_tokens: int) -> tuple[list[int], list[int]] | None:
    ids, flags = ids[:max_tokens], flags[:max_tokens]
    labels = [token if flag else IGNORE for token, flag in zip(ids[1:], flags[1:])] + [IGNORE]
    return (ids, labels) if any(label != IGNORE for label in labels) else None


def encode_pairs(tokenizer: Any, items: Sequence[Comparison], max_tokens: int) -> list[EncodedPair]:
    """Every (better, worse) pair of every item, in item order; pairs whose response falls wholly
    beyond `max_tokens` are left out."""
    pairs = []
    for item in items:
        encoded = [encode_response(tokenizer, item.prompt, r) for r in item.responses]
        for better, worse in item.preference_pairs():
            chosen = _shifted(*encoded[better], max_tokens)
            rejected = _shifted(*encoded[worse], max_tokens)
            if chosen and rejected:
                pairs.append(EncodedPair(chosen[0], chosen[1], rejected[0], rejected[1]))
    return pairs


@dataclass(frozen=True, slots=True)
class PairBatch:
    """2B rows: the B chosen sequences, then their B rejected ones; right-padded."""

    input_ids: torch.Tensor  # (2B, T) int64
    labels: torch.Tensor  # (2B, T) next-token targets on response tokens, IGNORE elsewhere
    attention_mask: torch.Tensor  # (2B, T)

    @property
    def num_pairs(self) -> int:
        return self.input_ids.shape[0] // 2

    def to(self, device: torch.device) -> PairBatch:
        return PairBatch(self.input_ids.to(device), self.labels.to(device),
                         self.attention_mask.to(device))


def collate_pairs(pairs: Sequence[EncodedPair], pad_id: int) -> PairBatch:
    rows = [(p.chosen, p.chosen_labels) for p in pairs] + [(p.rejected, p.rejected_labels) for p in pairs]
    return PairBatch(*pad_rows(rows, pad_id))


def pad_token_id(tokenizer: Any) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


class PairSamples:
    """Training pairs, drawn by run-wide sample number like the other tasks' samples."""

    def __init__(self, tokenizer: Any, items: Sequence[Comparison], seq_len: int, seed: int,
                 where: str) -> None:
        self.pairs = encode_pairs(tokenizer, items, seq_len)
        if not self.pairs:
            raise ConfigError(f"{where}: no preference pair within data.seq_len={seq_len} tokens "
                              "(items need labels with a majority choice)")
        self._pad_id = pad_token_id(tokenizer)
        self._order = EpochShuffle(len(self.pairs), seed)

    def __len__(self) -> int:
        return len(self.pairs)

    def batch(self, samples: range) -> PairBatch:
        return collate_pairs([self.pairs[self._order(sample)] for sample in samples], self._pad_id)


def sequence_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the response tokens' log-probabilities, their count) per row; logits (N, T, V)."""
    mask = labels != IGNORE
    targets = labels.clamp_min(0)
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (logprobs * mask).sum(-1), mask.sum(-1)


class PairwiseTask(SupervisedTask):
    """A task trained on comparison pairs (the reward model, DPO): the tokenizer of the model it
    starts from, the comparisons' train split as PairSamples and the validation split encoded once;
    batches count pairs."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.tokenizer_dir = Path(config.model.init_from)
        self.tokenizer = load_tokenizer(self.tokenizer_dir)
        splits = load_comparison_splits(config.data.comparisons)
        self.data_version = splits.version
        self.train_samples = PairSamples(self.tokenizer, splits.train, config.data.seq_len,
                                         config.seed, config.data.comparisons)
        self.val_pairs = encode_pairs(self.tokenizer, splits.val, config.data.seq_len)

    def count(self, batch: PairBatch) -> int:
        return batch.num_pairs

    def has_evaluation(self) -> bool:
        return bool(self.val_pairs)
