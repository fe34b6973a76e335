"""AWQ checkpoints (AutoAWQ's GEMM layout, as transformers and vLLM read them): served as int4 from
their own codes, or dequantized at load.

Per quantized linear `<m>` (in_features -> out_features), 4 bits, groups of `group_size` inputs:
  <m>.qweight  int32 (in, out / 8)      codes packed along the output dim
  <m>.qzeros   int32 (in / group, out / 8)
  <m>.scales   fp16  (in / group, out)
Eight 4-bit values share a word in AWQ's interleaved order: nibble j of word w holds output column
8 * w + AWQ_ORDER[j]. weight[o, i] = scales[i // group, o] * (qweight[i, o] - qzeros[i // group, o]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvik.core.errors import ConfigError
from kvik.model.formats.packed_ints import unpack_int32
from kvik.model.quant.prequantized import PrequantizedWeight, int4_from_zero_points, unfit_group_reason

PARTS = ("qweight", "qzeros", "scales")
REQUIRED_PARTS = PARTS
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True, slots=True)
class AWQFormat:
    bits: int
    group_size: int

    @classmethod
    def from_quantization_config(cls, config: dict[str, Any]) -> AWQFormat:
        bits = config.get("bits", config.get("w_bit", 4))
        if bits != 4:
            raise ConfigError(f"quantization_config.bits: AWQ with {bits} bits is not supported; "
                              "kvik loads 4-bit AWQ")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ConfigError(f"quantization_config.version: AWQ {version!r} layout is not "
                              "supported; kvik loads the 'gemm' layout")
        if not config.get("zero_point", True):
            raise ConfigError("quantization_config.zero_point: AWQ without zero points is not "
                              "supported")
        group_size = int(config.get("group_size", config.get("q_group_size", 128)))
        return cls(bits=bits, group_size=group_size)

    def unpack(self, name: str, parts: dict[str, torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """codes (in, out), zeros (groups, out), scales (groups, out) as stored, group size."""
        codes = unpack_int32(parts["qweight"], self.bits, dim=1, order=AWQ_ORDER)  # (in, out)
        zeros = unpack_int32(parts["qzeros"], self.bits, dim=1, order=AWQ_ORDER)  # (groups, out)
        scales = parts["scales"]
        in_features = codes.shape[0]
        group = in_features if self.group_size == -1 else self.group_size
        if in_features % group or scales.shape != zeros.shape \
                or scales.shape != (in_features // group, codes.shape[1]):
            raise ConfigError(f"{name}: AWQ tensors disagree: qweight unpacks to "
                              f"{tuple(codes.shape)}, qzeros to {tuple(zeros.shape)}, scales "
                              f"{tuple(scales.shape)} with group size {group}")
        return codes, zeros, scales, group

    def dequantize(self, name: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """float32 (out_features, in_features) weight of the linear whose parts are given."""
        codes, zeros, scales, group = self.unpack(name, parts)
        weight = (codes - zeros.repeat_interleave(group, 0)).float() \
            * scales.float().repeat_interleave(group, 0)
        return weight.t().contiguous()

    def prequantized(self, name: str, parts: dict[str, torch.Tensor]) -> PrequantizedWeight:
        """The linear as kvik's int4 from its own codes when they fit, else with the reason."""
        codes, zeros, scales, group = self.unpack(name, parts)
        shape = (codes.shape[1], codes.shape[0])

        def dequantize() -> torch.Tensor:
            return self.dequantize(name, parts)

        reason = unfit_group_reason(group)
        int4 = reason or int4_from_zero_points(codes.t(), scales.t(), zeros.t(), group)
        if isinstance(int4, str):
            return PrequantizedWeight.unfit("AWQ", shape, int4, dequantize)
        return PrequantizedWeight("AWQ", shape, int4, "", dequantize)
