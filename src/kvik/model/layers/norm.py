"""Normalisation layers with HF's numerics (statistics in float32, cast back before the scale).

kvik.model.transforms replaces them on CPU float32 models with FusedRMSNorm, which does each norm
(and the residual add before it) in one pass of a compiled kernel. On CUDA the norm is torch's own
`rms_norm`: one kernel where the formula below launches eight, and a GPU decode step is bound by
launching small kernels (docs: README, "On a GPU"). It also computes the statistics in float32 but
applies the scale before casting back, so in bfloat16 a value can differ from HF's by one rounding;
in float32 the two agree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
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
