"""The quantization pass: every nn.Linear of a loaded model becomes a WeightOnlyLinear."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from kvik.model.quant.linear import WeightOnlyLinear
from kvik.model.quant.scheme import QuantScheme

logger = logging.getLogger("kvik.model")


def quantize_model(model: nn.Module, scheme: QuantScheme, kernels: Any = None,
                   bf16_gemm: bool = False) -> int:
    """Replace each nn.Linear in `model` with a WeightOnlyLinear in `scheme`'s format, layer by layer
    (each float weight is released as soon as it is replaced, unless something else holds it, like a
    tied embedding). `kernels`: the compiled CPU kernels, for CPU float32 models. Returns how many."""
    lm_head = getattr(model, "lm_head", None)
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            kind = scheme.kind_for(child is lm_head)
            layer = WeightOnlyLinear.from_linear(child, kind, scheme.group_for(kind), scheme.zero_point)
            if kernels is not None and child.weight.device.type == "cpu":
                layer.enable_kernels(kernels, bf16_gemm=bf16_gemm and kind == "bfloat16")
            setattr(parent, name, layer)
            replaced += 1
    logger.info("weights: %d linear layers stored as %s", replaced, scheme.describe())
    return replaced
