"""A linear layer whose weight is held as bfloat16, int8 or int4 (kvik's blocked layout).

On the CPU with the compiled kernels, batches of up to `SMALL_BATCH_ROWS` rows run a kernel that
widens the weights in registers and streams each block once per four rows (decoding: the bytes per
token shrink with the format). Larger batches (prefill) are bound by arithmetic, not bytes: the
weight is widened into a float32 matrix once per call and multiplied by the BLAS GEMM. On CPUs
with bfloat16 arithmetic, bfloat16 weights instead multiply bfloat16-rounded rows in the kernel's
AVX512-BF16 tiles, straight from the stored blocks, from 12 rows on (decode steps of a dozen
requests or more included: csrc/weight_only_cpu.cpp kBf16DotMinRows); where the kernel was built
without them, batches past `SMALL_BATCH_ROWS` go to oneDNN's bfloat16 GEMM on a per-call copy (the
copy made short prompts 1.5-2.3x slower). On CPUs with AVX512-VNNI, int8 and int4 weights
instead multiply activations rounded to int8 in integer arithmetic, at every batch size (faster than
both paths above, for decode and prefill alike), unless the weight's `allow_int8_activations` (the
engine's `--activations`) or `kernels.set_int8_activations(False)` turns it off. Without the kernels (CUDA, or no compiler) the weight is dequantized with PyTorch ops on every
call and multiplied in the input's dtype: correct everywhere, fast nowhere.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvik.model.quant import packing
from kvik.model.quant.reference import (DEFAULT_GROUP_SIZES, Int4Weight, Int8Weight, dequantize_int4,
                                        dequantize_int8, quantize_int4, quantize_int8)

# csrc/kernels.h WeightFormat
FORMAT_CODES = {"bfloat16": 1, "int8": 2, "int4": 3}
# Up to this many rows the in-register kernel beats widening the weight for a GEMM: on the 125M
# reference model's 2048 x 768 weights (AVX2, one thread) it took 4 / 17 / 31 / 59 ms for eight
# int8 layers at 4 / 16 / 32 / 64 rows against 48 / 53 / 63 / 84 ms widened (int4 and bfloat16: the
# kernel faster still) and 15 / 21 / 28 / 37 ms for float32 on oneDNN. Its passes of four rows
# re-read each block from cache; the GEMM path writes and reads a float32 copy of the weight.
SMALL_BATCH_ROWS = 32


class WeightOnlyLinear(nn.Module):
    """y = x W^T + b with W stored narrow; activations and results in the input's dtype."""

    def __init__(self, kind: str, in_features: int, out_features: int, data: torch.Tensor,
                 scales: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                 group_size: int = 0, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if kind not in FORMAT_CODES:
            raise ValueError(f"weight format {kind!r} is not one of {', '.join(FORMAT_CODES)}")
        self.kind, self.group_size = kind, group_size
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("data", data)
        self.register_buffer("scales", scales)
        self.register_buffer("offsets", offsets)
        self.register_buffer("bias", bias)
        self._kernel: Any = None
        self._bf16_gemm = False

    @classmethod
    def from_linear(cls, linear: nn.Module, kind: str, group_size: int | None = None,
                    zero_point: bool = False) -> WeightOnlyLinear:
        """`group_size`: inputs per scale; None takes the format's default (int4 64, int8 32; int8
        takes 0 for a scale per output row)."""
        if kind not in FORMAT_CODES:
            # A typo ("bf16") must not quietly become the narrowest format.
            raise ValueError(f"unknown weight format {kind!r}: choose one of {', '.join(FORMAT_CODES)}")
        weight = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        if kind == "bfloat16":
            return cls(kind, linear.in_features, linear.out_features, packing.pack_bfloat16(weight), bias=bias)
        if kind == "int8":
            group = DEFAULT_GROUP_SIZES["int8"] if group_size is None else group_size
            return cls.from_int8(quantize_int8(weight, group), bias)
        return cls.from_int4(quantize_int4(weight, group_size or DEFAULT_GROUP_SIZES["int4"], zero_point), bias)

    @classmethod
    def from_int8(cls, q: Int8Weight, bias: torch.Tensor | None = None) -> WeightOnlyLinear:
        """From values (N, K) int8 and float32 scales per row or float16 scales per group (a loader's
        hook for int8 checkpoints, GGUF Q8_0 among them)."""
        data, scales = packing.pack_int8(q)
        rows, columns = q.values.shape
        return cls("int8", columns, rows, data, scales, group_size=q.group_size, bias=bias)

    @classmethod
    def from_int4(cls, q: Int4Weight, bias: torch.Tensor | None = None) -> WeightOnlyLinear:
        """From values (N, K) in [0, 15], float16 scales and offsets per group (GPTQ/AWQ/GGUF
        loaders map their zero points z to offsets -z * scale)."""
        data, scales, offsets = packing.pack_int4(q)
        rows, columns = q.values.shape
        return cls("int4", columns, rows, data, scales, offsets, q.group_size, bias)

    # -- kernels --

    def enable_kernels(self, kernels: Any, bf16_gemm: bool = False) -> None:
        """Run on kvik's compiled CPU kernels; with bf16_gemm, large batches multiply in bfloat16
        (for CPUs with AVX512-BF16 / AMX: the kernel's bfloat16 tiles where it has them, else a GEMM). int8/int4 weights take int8-rounded activations where the
        CPU has AVX512-VNNI unless `kernel_weight().allow_int8_activations` is set to False."""
        self._kernel = kernels.LinearWeight.weight_only(
            FORMAT_CODES[self.kind], self.data, self.scales, self.offsets, self.out_features,
            self.in_features, self.group_size, self.bias)
        self._kernel.allow_bf16_activations = bf16_gemm
        self._bf16_gemm = bf16_gemm

    def kernel_weight(self) -> Any:
        """The compiled kernels' handle on this weight (for the decode stack), or None."""
        return self._kernel

    # -- computing --

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a dense (N, K) tensor, with PyTorch ops (any device)."""
        if self.kind == "bfloat16":
            return packing.unpack_bfloat16(self.data, self.out_features).to(dtype)
        if self.kind == "int8":
            unpacked8 = packing.unpack_int8(self.data, self.scales, self.out_features, self.group_size)
            return dequantize_int8(unpacked8).to(dtype)
        unpacked = packing.unpack_int4(self.data, self.scales, self.offsets, self.out_features, self.in_features,
                                       self.group_size)
        return dequantize_int4(unpacked).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self._kernel is None or rows.dtype != torch.float32:
            out = F.linear(rows, self.dequantize(rows.dtype),
                           None if self.bias is None else self.bias.to(rows.dtype))
        elif (rows.shape[0] <= SMALL_BATCH_ROWS or self._kernel.int8_activations()
              or self._kernel.bf16_prompt_tiles()
              or (not self._bf16_gemm and self._kernel.prompt_tiles())):
            # (CPUs with native bfloat16 multiply prompts faster in bfloat16, in the kernel's tiles
            # where it has them, than in float32 FMA tiles.)
            out = self._kernel(rows.contiguous())
        elif self._bf16_gemm:
            weight = self._kernel.dequantize_transposed(True)  # (K, N) bfloat16
            out = torch.mm(rows.to(torch.bfloat16), weight).float()
            if self.bias is not None:
                out += self.bias
        else:
            weight = self._kernel.dequantize_transposed(False)  # (K, N) float32
            out = torch.mm(rows, weight) if self.bias is None else torch.addmm(self.bias, rows, weight)
        return out.view(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        """Bytes this layer streams per pass over its weight (data, scales, offsets, bias)."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.offsets, self.bias)
                   if t is not None)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        zero = ", zero_point=True" if self.offsets is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weights={self.kind}{group}{zero}, kernels={self._kernel is not None}")
