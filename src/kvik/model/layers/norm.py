"""Normalisation layers with HF's numerics (statistics in float32, cast back before the scale).

kvik.model.transforms replaces them on CPU float32 models with FusedRMSNorm, which does each norm
(and the residual add before it) in one pass of a compiled kernel.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual). Fused replacements work in place: `x` must be a fresh
        tensor the caller no longer needs (a projection's output)."""
        residual = x + residual
        return self(residual), residual
