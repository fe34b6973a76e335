"""Weights a checkpoint stores already quantized (GPTQ, AWQ, GGUF Q4_0/Q4_1/Q4_K), on their way to
kvik's int4 layers without a second rounding.

A format reader turns each quantized linear into a `PrequantizedWeight`: the checkpoint's own codes,
scales and zero points as an `Int4Weight` (values (N, K) in [0, 15], float16 scale and offset per
group, w = scale * v + offset) when they fit kvik's int4, plus a way back to the float weight the
checkpoint stands for (today's dequantization, used when they do not fit or a fused module cannot
take them). `kvik.model.weights.WeightLoader` joins the pieces of fused modules and swaps in the
`WeightOnlyLinear`s.

The one rounding on the way: a zero point z becomes the float16 offset -z * scale (and a GGUF Q4_K
scale d * sc and offset -dmin * m are rounded to float16). Rounding to nearest float16 is off by at
most 2**-11 of the value (2**-25 absolute below float16's normal range), so a weight moves by at most
2**-11 * |z * scale| <= scale / 128 (z <= 16): under 1 % of one quantization step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvik.model.quant.reference import INT4_GROUP_SIZES, Int4Weight

SYMMETRIC_ZERO = 8  # the zero point of kvik's symmetric int4 (offset = -8 * scale, stored as None)


@dataclass(slots=True)
class PrequantizedWeight:
    """One linear weight of a pre-quantized checkpoint, (out_features, in_features)."""

    source: str  # "GPTQ", "AWQ", "GGUF Q4_1": for log lines and the precision description
    shape: tuple[int, int]
    int4: Int4Weight | None  # the checkpoint's codes in kvik's int4; None when they do not fit
    unfit_reason: str  # why int4 is None ("" when it is not)
    dequantize: Callable[[], torch.Tensor]  # the float32 weight, exactly as the plain loader reads it

    @classmethod
    def unfit(cls, source: str, shape: tuple[int, int], reason: str,
              dequantize: Callable[[], torch.Tensor]) -> PrequantizedWeight:
        return cls(source, shape, None, reason, dequantize)


def unfit_group_reason(group_size: int) -> str:
    """Why a group size cannot be served as int4 directly, or "" when it can."""
    if group_size in INT4_GROUP_SIZES:
        return ""
    return (f"group size {group_size} (kvik's int4 kernels take groups of "
            f"{', '.join(map(str, INT4_GROUP_SIZES))})")


def int4_from_zero_points(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          group_size: int) -> Int4Weight | str:
    """kvik's int4 for w = scale * (v - zero): values (N, K) in [0, 15], scales (N, G) float16, zeros
    (N, G) integers. Offsets are float16(-zero * scale), or None when every zero point is 8 (the
    symmetric layout, exact). Returns the reason instead when the offsets overflow float16."""
    if scales.dtype != torch.float16:
        narrow = scales.to(torch.float16)
        if not torch.equal(narrow.to(scales.dtype), scales):
            return f"scales stored as {str(scales.dtype).removeprefix('torch.')} do not fit float16"
        scales = narrow
    offsets = None
    if not bool((zeros == SYMMETRIC_ZERO).all()):
        # -z * s is exact in float32 (5 x 11 significant bits); one rounding to float16.
        offsets = (-zeros.float() * scales.float()).to(torch.float16)
        if not bool(torch.isfinite(offsets).all()):
            return "zero point times scale overflows float16"
    return Int4Weight(values.to(torch.uint8).contiguous(), scales.contiguous(),
                      None if offsets is None else offsets.contiguous(), group_size)


def concat_rows(pieces: list[Int4Weight]) -> Int4Weight:
    """One Int4Weight from pieces stacked along the output rows (all of one group size and K). A
    symmetric piece joined to ones with zero points gets its exact offsets, -8 * scale."""
    group = pieces[0].group_size
    if any(p.group_size != group or p.values.shape[1] != pieces[0].values.shape[1] for p in pieces):
        raise ValueError("int4 pieces differ in group size or input features")
    offsets = None
    if any(p.offsets is not None for p in pieces):
        offsets = torch.cat([p.offsets if p.offsets is not None
                             else (p.scales.float() * -SYMMETRIC_ZERO).to(torch.float16) for p in pieces])
    return Int4Weight(torch.cat([p.values for p in pieces]), torch.cat([p.scales for p in pieces]),
                      offsets, group)


@dataclass(slots=True)
class CheckpointInt4:
    """What a load kept as int4 straight from the checkpoint, for the precision line and the log."""

    sources: set[str] = field(default_factory=set)
    group_sizes: set[int] = field(default_factory=set)
    zero_points: bool = False  # some layer has offsets (zero points) rather than symmetric codes
    layers: int = 0  # linear modules built from the checkpoint's codes
    dequantized: int = 0  # linear modules with pre-quantized pieces loaded as float instead
    nbytes: int = 0  # bytes of the int4 layers (packed codes, scales, offsets, biases)

    def describe(self) -> str:
        groups = "/".join(map(str, sorted(self.group_sizes)))
        zeros = "zero points" if self.zero_points else "symmetric"
        text = (f"int4 from the checkpoint ({' + '.join(sorted(self.sources))}, groups of {groups}, {zeros}; "
                f"{self.layers} linear layers")
        if self.dequantized:
            text += f", {self.dequantized} dequantized"
        return text + ")"
