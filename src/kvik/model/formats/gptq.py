"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum layout): served as int4 from their own codes, or
dequantized at load.

Per quantized linear `<m>` (in_features -> out_features), with b = bits and g groups:
  <m>.qweight  int32 (in * b / 32, out)   b-bit codes, packed along the input dim, low bits first
  <m>.qzeros   int32 (g, out * b / 32)    b-bit zero points, packed along the output dim
  <m>.scales   fp16  (g, out)
  <m>.g_idx    int32 (in,)                group of each input channel (absent: i // group_size)
weight[o, i] = scales[g_idx[i], o] * (qweight[i, o] - zero[g_idx[i], o]), where the stored zero is
one less than the real one in the original "gptq" checkpoint format and equal in "gptq_v2".

kvik's int4 takes the codes as they are when bits is 4, the group size is one its kernels take and
g_idx is the plain i // group_size; act-order checkpoints (desc_act, a reordering g_idx) would need
the activations permuted too, so they are dequantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvik.core.errors import ConfigError
from kvik.model.formats.packed_ints import unpack_int32
from kvik.model.quant.prequantized import PrequantizedWeight, int4_from_zero_points, unfit_group_reason

PARTS = ("qweight", "qzeros", "scales", "g_idx")
REQUIRED_PARTS = ("qweight", "qzeros", "scales")


@dataclass(frozen=True, slots=True)
class GPTQCodes:
    """One linear's unpacked GPTQ tensors, input-major as stored."""

    codes: torch.Tensor  # (in, out) int32
    zeros: torch.Tensor  # (groups, out) int32, the real zero points
    scales: torch.Tensor  # (groups, out) as stored (float16)
    g_idx: torch.Tensor  # (in,) int64
    plain_groups: bool  # g_idx == i // group_size: groups of consecutive inputs


@dataclass(frozen=True, slots=True)
class GPTQFormat:
    bits: int
    group_size: int  # -1: one group spans all input channels
    zero_offset: int  # added to the stored zero points (1 in the v1 "gptq" format)

    @classmethod
    def from_quantization_config(cls, config: dict[str, Any]) -> GPTQFormat:
        bits = config.get("bits", 4)
        if bits not in (2, 4, 8):
            raise ConfigError(f"quantization_config.bits: GPTQ with {bits} bits is not supported; "
                              "kvik loads 2, 4 and 8 bits")
        checkpoint_format = config.get("checkpoint_format", "gptq")
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ConfigError(f"quantization_config.checkpoint_format: {checkpoint_format!r} is not "
                              "supported; kvik loads 'gptq' and 'gptq_v2'")
        return cls(bits=bits, group_size=int(config.get("group_size", 128)),
                   zero_offset=1 if checkpoint_format == "gptq" else 0)

    def _group(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    def unpack(self, name: str, parts: dict[str, torch.Tensor]) -> GPTQCodes:
        codes = unpack_int32(parts["qweight"], self.bits, dim=0)  # (in, out)
        in_features, out_features = codes.shape
        zeros = unpack_int32(parts["qzeros"], self.bits, dim=1)[:, :out_features] + self.zero_offset
        scales = parts["scales"]  # (groups, out)
        plain = torch.arange(in_features) // self._group(in_features)
        g_idx = parts.get("g_idx")
        g_idx = plain if g_idx is None else g_idx.long()
        if scales.shape != (zeros.shape[0], out_features) or g_idx.shape != (in_features,) \
                or int(g_idx.max()) >= scales.shape[0] or int(g_idx.min()) < 0:
            raise ConfigError(f"{name}: GPTQ tensors disagree: qweight unpacks to "
                              f"{(in_features, out_features)}, scales {tuple(scales.shape)}, "
                              f"zeros {tuple(zeros.shape)}, g_idx {tuple(g_idx.shape)}")
        return GPTQCodes(codes, zeros, scales, g_idx, torch.equal(g_idx, plain))

    def dequantize(self, name: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """float32 (out_features, in_features) weight of the linear whose parts are given."""
        q = self.unpack(name, parts)
        weight = (q.codes - q.zeros[q.g_idx]).float() * q.scales.float()[q.g_idx]  # (in, out)
        return weight.t().contiguous()

    def prequantized(self, name: str, parts: dict[str, torch.Tensor]) -> PrequantizedWeight:
        """The linear as kvik's int4 from its own codes when they fit, else with the reason."""
        q = self.unpack(name, parts)
        in_features, out_features = q.codes.shape
        shape = (out_features, in_features)

        def dequantize() -> torch.Tensor:
            return self.dequantize(name, parts)

        group = self._group(in_features)
        reason = (f"{self.bits}-bit codes" if self.bits != 4
                  else "act-order (g_idx reorders the groups)" if not q.plain_groups
                  else unfit_group_reason(group))
        if reason:
            return PrequantizedWeight.unfit("GPTQ", shape, reason, dequantize)
        int4 = int4_from_zero_points(q.codes.t(), q.scales.t(), q.zeros.t(), group)
        if isinstance(int4, str):
            return PrequantizedWeight.unfit("GPTQ", shape, int4, dequantize)
        return PrequantizedWeight("GPTQ", shape, int4, "", dequantize)
