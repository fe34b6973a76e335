"""Causal-LM samples from token shards: fixed windows of seq_len + 1 tokens (input and shifted target).

Windows start at multiples of seq_len and overlap by one token, so every token but the first is a
target exactly once per epoch. Documents are separated by end-of-text tokens inside the stream, as
in GPT-2 and nanoGPT; attention crosses document boundaries (the model learns to reset at EOS).
"""

from __future__ import annotations

import torch

from kvik.core.errors import ConfigError
from kvik.train.batches import Batch, EpochShuffle
from kvik.train.shards import TokenStream


class PretrainSamples:
    def __init__(self, stream: TokenStream, seq_len: int, seed: int, *, shuffle: bool = True) -> None:
        self.num_windows = (len(stream) - 1) // seq_len
        if self.num_windows < 1:
            raise ConfigError(f"data.seq_len: the split has {len(stream)} tokens, fewer than one "
                              f"sample of {seq_len + 1}")
        self._stream = stream
        self._seq_len = seq_len
        self._order = EpochShuffle(self.num_windows, seed) if shuffle else None

    def batch(self, samples: range) -> Batch:
        rows = []
        for sample in samples:
            window = self._order(sample) if self._order else sample % self.num_windows
            rows.append(torch.from_numpy(self._stream.read(window * self._seq_len, self._seq_len + 1)))
        tokens = torch.stack(rows)  # (B, T + 1)
        return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), None)
