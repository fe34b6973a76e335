"""Switch a model's norms, rotary embedding and SiLU-gating to kvik's compiled CPU kernels.

A pass over the finished model: it sets `fused_ops` on the layers that have a fused path (RMSNorm,
the Llama family's attention and MLP). At decode batch sizes each of those chains of small PyTorch
ops costs more in dispatch and memory passes than in arithmetic.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def enable_cpu_fused_ops(model: nn.Module, kernels: Any) -> int:
    """Give every module with a `fused_ops` slot the compiled kernels; returns how many."""
    enabled = 0
    for module in model.modules():
        if hasattr(module, "fused_ops"):
            module.fused_ops = kernels
            enabled += 1
    return enabled
