"""Rotary position embeddings (the "rotate half" layout HF uses), with Llama-3 and linear scaling.

cos/sin are precomputed in float32 for every position up to the context length and looked up by
each token's absolute position, so a flat batch mixing prompts and decodes needs no extra work.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """(head_dim/2,) float32 inverse frequencies after the configured scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, and the band in
        # between interpolated smoothly.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def build_cache(self, device: torch.device, dtype: torch.dtype) -> None:
        """Compute the (max_positions, head_dim) tables. Called after weights are materialised,
        because the model is built on the meta device."""
        inv_freq = inverse_frequencies(self.head_dim, self.theta, self.scaling)
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (T, D) for a batch's positions; looked up once per step, used by every
        layer."""
        return self.cos[positions], self.sin[positions]


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (T, H, D), k: (T, Hkv, D), cos/sin: (T, 1, D) -> rotated q, k."""
    return rotate(q, cos, sin), rotate(k, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, D), cos/sin: (T, 1, D) -> x rotated by its token's position (HF's formula)."""
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
