"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum layout), dequantized at load.

Per quantized linear `<m>` (in_features -> out_features), with b = bits and g groups:
  <m>.qweight  int32 (in * b / 32, out)   b-bit codes, packed along the input dim, low bits first
  <m>.qzeros   int32 (g, out * b / 32)    b-bit zero points, packed along the output dim
  <m>.scales   fp16  (g, out)
  <m>.g_idx    int32 (in,)                group of each input channel (absent: i // group_size)
weight[o, i] = scales[g_idx[i], o] * (qweight[i, o] - zero[g_idx[i], o]), where the stored zero is
one less than the real one in the original "gptq" checkpoint format and equal in "gptq_v2".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvik.core.errors import ConfigError
from kvik.model.formats.packed_ints import unpack_int32

PARTS = ("qweight", "qzeros", "scales", "g_idx")
REQUIRED_PARTS = ("qweight", "qzeros", "scales")


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

    def dequantize(self, name: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """float32 (out_features, in_features) weight of the linear whose parts are given."""
        qweight = unpack_int32(parts["qweight"], self.bits, dim=0)  # (in, out)
        in_features, out_features = qweight.shape
        zeros = unpack_int32(parts["qzeros"], self.bits, dim=1)[:, :out_features] + self.zero_offset
        scales = parts["scales"].float()  # (groups, out)
        g_idx = parts.get("g_idx")
        if g_idx is None:
            size = in_features if self.group_size == -1 else self.group_size
            g_idx = torch.arange(in_features) // size
        g_idx = g_idx.long()
        if scales.shape != (zeros.shape[0], out_features) or g_idx.shape != (in_features,) \
                or int(g_idx.max()) >= scales.shape[0] or int(g_idx.min()) < 0:
            raise ConfigError(f"{name}: GPTQ tensors disagree: qweight unpacks to "
                              f"{(in_features, out_features)}, scales {tuple(scales.shape)}, "
                              f"zeros {tuple(zeros.shape)}, g_idx {tuple(g_idx.shape)}")
        weight = (qweight - zeros[g_idx]).float() * scales[g_idx]  # (in, out)
        return weight.t().contiguous()
