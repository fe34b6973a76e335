"""Which samples each process trains on at each step, as a pure function of the step.

Sample number g of a run (counting over all steps, micro-batches and ranks) maps to an item through
a fresh seeded permutation per epoch. Because g is computed from the step alone, the data position
in a checkpoint is just the step: resuming replays exactly the batches an uninterrupted run sees,
with no sampler state to save.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class Batch:
    input_ids: torch.Tensor  # (B, T) int64
    labels: torch.Tensor  # (B, T) int64, the next token at each position; -100 = no loss
    attention_mask: torch.Tensor | None  # (B, T) 1 = real token; None when there is no padding

    def to(self, device: torch.device) -> Batch:
        mask = None if self.attention_mask is None else self.attention_mask.to(device)
        return Batch(self.input_ids.to(device), self.labels.to(device), mask)

    @property
    def num_label_tokens(self) -> int:
        return int((self.labels != -100).sum())


class EpochShuffle:
    """Run-wide sample number -> item index, each epoch a different seeded permutation."""

    def __init__(self, num_items: int, seed: int) -> None:
        if num_items < 1:
            raise ValueError("nothing to sample from")
        self.num_items = num_items
        self._seed = seed
        self._epoch = -1
        self._order = np.zeros(0, dtype=np.int64)

    def __call__(self, sample: int) -> int:
        epoch, position = divmod(sample, self.num_items)
        if epoch != self._epoch:  # samples arrive in order, so this runs once per epoch
            self._order = np.random.default_rng([self._seed, epoch]).permutation(self.num_items)
            self._epoch = epoch
        return int(self._order[position])


def sample_numbers(step: int, micro_step: int, rank: int, world_size: int, micro_batch_size: int,
                   grad_accum_steps: int) -> range:
    """Run-wide sample numbers of one micro-batch of one rank (steps count from 0)."""
    per_step = micro_batch_size * grad_accum_steps * world_size
    start = step * per_step + (micro_step * world_size + rank) * micro_batch_size
    return range(start, start + micro_batch_size)
