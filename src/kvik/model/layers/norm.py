"""Normalisation layers with HF's numerics (statistics in float32, cast back before the scale).

`fused_ops` is set by `kvik.model.transforms.cpu_fused_ops` on CPU float32 models: the compiled
kernels then do each norm (and the residual add before it) in one pass.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused_ops: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_ops is not None:
            x = x.contiguous()
            out = torch.empty_like(x)
            self.fused_ops.rms_norm(out, x, self.weight, self.eps)
            return out
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual). The fused path works in place: `x` must be a fresh
        tensor the caller no longer needs (a projection's output)."""
        if self.fused_ops is not None:
            self.fused_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self(residual), residual
