"""Run every nn.Linear through oneDNN with weights prepacked into its blocked layout (CPU, float32).

On the CPUs measured here (AMD EPYC with AVX-512) oneDNN on prepacked weights runs the small-batch
GEMMs of decoding 1.3-1.8x faster than the default BLAS path (M=16..64 rows: ~190-220 GFLOP/s
against ~80-165), and large prefill GEMMs a little faster too. Packing happens once after loading;
the dense weights are released unless something else (a tied embedding) still holds them.

For 1-8 rows (decoding a single sequence or a few) a compiled matrix-vector kernel reads the same
packed weights at close to the machine's streaming bandwidth, where oneDNN's small-M kernels reach
60-70 % of it; it is used only where the packed layout was checked to be the one it reads.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any

import torch
from torch import nn

logger = logging.getLogger("kvik.model")

# oneDNN picks its blocked layout for an expected batch. Streaming weights from DRAM (the model does
# not fit the cache), a layout for 16 rows measured best at 1 and 16 rows and within 3 % at 64.
PACKING_BATCH_HINT = 16
# oneDNN's kernels for 1-5 rows stream the weights slower than its 6-row kernel (this model's 49
# matrices: 18.7 ms at 1 row, 13.5 ms at 6), so small batches pad their rows with zeros when the
# compiled GEMV below is not there to take them.
MIN_ROWS = 6
# Up to this many rows the compiled matrix-vector kernel runs instead (csrc/gemv_cpu.cpp): measured
# 31-33 GB/s against oneDNN's 19-28 at 1-4 rows, on the same weights. Past four rows it makes a
# second pass over each block from cache: all 49 matrices of the 125M reference model, one thread
# (AVX-512 EPYC), 5-8 rows took 21-27 ms against oneDNN's 26-34 (1.12-1.28x); at 12 rows oneDNN
# is ahead. Steps of a few decodes plus a short prefill chunk land here.
GEMV_MAX_ROWS = 8
GEMV_BLOCKS = (16, 32, 64)


class OneDNNLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's packed layout (not a parameter: inference only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACKING_BATCH_HINT)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self._gemv: Any = None
        self._gemv_args: tuple[int, int, int, int] = (0, 0, 0, 0)
        self._kernels: Any = None

    def enable_gemv(self, kernels: Any, layout: tuple[int, int]) -> bool:
        """Use kernels.gemv_packed for small batches if it agrees with oneDNN on this weight."""
        block, in_stride = layout
        args = (torch.ops.mkldnn.data_ptr(self.packed), self.out_features, in_stride, block)
        probe = torch.randn(2, self.in_features, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            expected = self(probe)
            got = kernels.gemv_packed(probe, *args, self.bias)
        if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
            logger.warning("packed GEMV disagrees with oneDNN on a %dx%d weight; not using it",
                           self.out_features, self.in_features)
            return False
        self._gemv, self._gemv_args, self._kernels = kernels.gemv_packed, args, kernels
        return True

    def kernel_weight(self) -> Any:
        """The compiled kernels' handle on the packed weight (for the decode stack, 1-4 rows), or
        None when the small-batch GEMV is not enabled for this weight."""
        if self._kernels is None:
            return None
        address, out_features, in_stride, block = self._gemv_args
        return self._kernels.LinearWeight.packed_float32(address, out_features, self.in_features, in_stride,
                                                         block, self.bias)

    def gemv_spec(self) -> tuple[int, int, int, int, torch.Tensor | None] | None:
        """(address, out_features, in_stride, block, bias) of the packed layout the small-batch GEMV
        reads (weight sync writes into it in place), or None when that GEMV is not enabled here."""
        return None if self._gemv is None else (*self._gemv_args, self.bias)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weight (and bias) streamed per pass."""
        total = torch.ops.mkldnn._nbytes(self.packed)
        return total + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        count = rows.shape[0]
        if self._gemv is not None and 0 < count <= GEMV_MAX_ROWS:
            out = self._gemv(rows.contiguous(), *self._gemv_args, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        if count < MIN_ROWS:
            padded = rows.new_zeros(MIN_ROWS, self.in_features)
            padded[:count] = rows
            rows = padded
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        if count < MIN_ROWS:
            out = out[:count]
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def onednn_available() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:  # the ops are private; make sure this build has them and they agree with F.linear
        probe = nn.Linear(8, 4)
        x = torch.randn(3, 8)
        with torch.inference_mode():
            return bool(torch.allclose(OneDNNLinear(probe)(x), probe(x), atol=1e-5))
    except Exception:  # noqa: BLE001 - any failure means: use the default path
        return False


def _packed_floats(packed: torch.Tensor) -> torch.Tensor:
    """A float32 view of a prepacked weight's raw buffer (valid while `packed` lives)."""
    count = torch.ops.mkldnn._nbytes(packed) // 4
    buffer = (ctypes.c_float * count).from_address(torch.ops.mkldnn.data_ptr(packed))
    return torch.frombuffer(buffer, dtype=torch.float32)


# Weights above this many elements are probed with fewer rows (the same remainder modulo 512): the
# probe packs two index matrices of its shape, which for a large LM head would be gigabytes.
PROBE_MAX_ELEMENTS = 2**24


def packed_gemv_layout(out_features: int, in_features: int) -> tuple[int, int] | None:
    """(block, in_stride) if oneDNN packs an out x in weight as [blocks][in_stride][block], the
    layout gemv_packed reads; None otherwise. The layout depends on the CPU and the shape, so it is
    read off by packing matrices that hold their own row and column indices (exact in float32 below
    2**24) and checking where every element landed. Large weights are probed at a smaller row count;
    enable_gemv then checks the kernel against oneDNN on the real weight."""
    if out_features * in_features > PROBE_MAX_ELEMENTS and out_features > 1024:
        out_features = 512 + out_features % 512
    return _probe_layout(out_features, in_features)


@functools.lru_cache(maxsize=None)
def _probe_layout(out_features: int, in_features: int) -> tuple[int, int] | None:
    if max(out_features, in_features) >= 2**24:
        return None
    placed = []
    for axis in (0, 1):
        index = torch.arange(out_features if axis == 0 else in_features, dtype=torch.float32)
        matrix = (index[:, None] if axis == 0 else index[None, :]).expand(out_features, in_features)
        packed = torch.ops.mkldnn._reorder_linear_weight(matrix.contiguous(), PACKING_BATCH_HINT)
        placed.append(_packed_floats(packed).clone())
        del packed
    rows, cols = placed
    block = next((b for b in sorted(GEMV_BLOCKS, reverse=True)
                  if rows.numel() >= b and torch.equal(rows[:b], torch.arange(b, dtype=torch.float32))), None)
    if block is None or (block < out_features and rows.numel() > block and rows[block] == block):
        return None  # the first run of consecutive rows is not a supported block
    blocks = -(-out_features // block)
    if rows.numel() % (blocks * block):
        return None
    in_stride = rows.numel() // (blocks * block)
    if in_stride < in_features:
        return None
    rows, cols = rows.view(blocks, in_stride, block), cols.view(blocks, in_stride, block)
    want_rows = torch.arange(blocks * block, dtype=torch.float32).view(blocks, 1, block)
    want_cols = torch.arange(in_features, dtype=torch.float32).view(1, in_features, 1)
    full = out_features // block  # blocks with no padded rows; the last one is checked row by row
    ok = (torch.equal(rows[:full, :in_features], want_rows[:full].expand(full, in_features, block))
          and torch.equal(cols[:full, :in_features], want_cols.expand(full, in_features, block)))
    if ok and full < blocks:
        tail = out_features - full * block
        ok = (torch.equal(rows[full, :in_features, :tail], want_rows[full, :, :tail].expand(in_features, tail))
              and torch.equal(cols[full, :in_features, :tail], want_cols[0].expand(in_features, tail)))
    return (block, in_stride) if ok else None


def pack_linears_for_onednn(model: nn.Module, kernels: Any = None) -> tuple[int, int]:
    """Replace each float32 CPU nn.Linear in `model` with a OneDNNLinear. With the compiled CPU
    kernels, small batches use their matrix-vector kernel where the layout fits. Returns (packed,
    with the small-batch kernel)."""
    replaced = gemv = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (isinstance(child, nn.Linear) and child.weight.device.type == "cpu"
                    and child.weight.dtype == torch.float32):
                packed = OneDNNLinear(child)
                setattr(parent, name, packed)
                replaced += 1
                if kernels is not None and hasattr(kernels, "gemv_packed"):
                    layout = packed_gemv_layout(packed.out_features, packed.in_features)
                    gemv += bool(layout and packed.enable_gemv(kernels, layout))
    logger.info("packed %d linear layers for oneDNN (%d with the small-batch GEMV)", replaced, gemv)
    return replaced, gemv
