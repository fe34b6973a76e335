"""A greedy decode's LM head read from an int8 copy, with the exact answer (csrc screened_argmax).

A greedy step needs the index of the largest logit. The LM head is a large part of what a small
model's single-stream step reads (a quarter of the 125M reference model's bytes), so the step reads
an int8 copy of the head (half a bfloat16 head's bytes, a quarter of a float32 one's), bounds how far
each copied logit can be from the exact one, and computes from the head's own weight only the
outputs whose bound reaches the best: the index is the full product's, bit for bit (the proof is in
weight_only_cpu.cpp, next to the kernel). The copy costs memory (a quarter of a float32 head's), so
it is made only for a bfloat16 or packed float32 head without a bias; `KVIK_SCREENED_HEAD=0` turns
it off. A head whose weights change (weight sync) drops its copy: `drop_screen`.
"""

from __future__ import annotations

import logging
import os
from typing import Any, NamedTuple

import torch

from kvik.model.quant.linear import WeightOnlyLinear
from kvik.model.quant.reference import dequantize_int8, quantize_int8
from kvik.model.transforms.onednn_linear import OneDNNLinear

logger = logging.getLogger("kvik.model")

GROUP_SIZE = 32  # float16 scales x int8 codes are exact in float32, so the bound is computed exactly
ACTIVATION_BLOCK = 32  # the kernels round int8 activations per block of this many inputs (kScreenBlock)
ROWS_PER_PASS = 4096  # the head is widened to float64 this many rows at a time (memory)


class ScreenedHead(NamedTuple):
    coarse: Any  # the int8 copy's compiled weight (float32 activations)
    bound: torch.Tensor  # (2, vocab) float32: |coarse - exact| <= bound[0] sum|x| + bound[1] sum(int8 steps)
    copy: WeightOnlyLinear  # holds the copy's tensors


def enabled() -> bool:
    return os.environ.get("KVIK_SCREENED_HEAD", "1") != "0"


def build_screened_head(head: torch.nn.Module, kernels: Any) -> ScreenedHead | None:
    """The int8 copy and bound for `head`, or None where screening does not apply (neither a
    bfloat16 weight-only head nor a packed float32 one on the compiled kernels, a bias, or turned
    off)."""
    if not (enabled() and kernels is not None and hasattr(kernels, "screened_argmax")
            and getattr(head, "bias", None) is None):
        return None
    if isinstance(head, WeightOnlyLinear) and head.kind == "bfloat16" and head.kernel_weight() is not None:
        exact = head.dequantize(torch.float32)  # bfloat16 values, exact in float32
    elif isinstance(head, OneDNNLinear) and head.gemv_spec() is not None:
        address, out_features, in_stride, block, _ = head.gemv_spec()
        exact = kernels.unpack_packed_float32(address, out_features, head.in_features, in_stride, block)
    else:
        return None
    q = quantize_int8(exact, GROUP_SIZE)
    in_features = head.in_features
    weights, steps = [], []
    # In float32: w and w' are exact there, and the rounding of these differences, maxima and
    # 32-term sums (relative 2^-19 at most) is far inside the 2^-10 added below.
    for first in range(0, exact.shape[0], ROWS_PER_PASS):
        w = exact[first:first + ROWS_PER_PASS]
        part = type(q)(q.values[first:first + ROWS_PER_PASS], q.scales[first:first + ROWS_PER_PASS], GROUP_SIZE)
        w_copy = dequantize_int8(part)  # scale x code: exact in float32
        error = (w - w_copy).abs_().amax(dim=1)
        w_copy.abs_()
        largest = torch.maximum(w.abs().amax(dim=1), w_copy.amax(dim=1))
        # Float32 sums of n products in any order: within ~n 2^-24 sum|x_i w_i| of the true sum, for
        # each of the two products; twice that again for the copy's scales, per-block sums and
        # int8 activations' scales (a generous count: this term is ~1 % of the error's).
        rounding = 4 * (in_features + 8) * 2.0 ** -24 * largest
        weights.append(error.double() + rounding.double())
        # int8 activations: |x_i - x'_i| <= 0.51 s_b moves output j by <= 0.51 s_b sum_{i in b} |w'_ji|.
        padded = torch.nn.functional.pad(w_copy, (0, -in_features % ACTIVATION_BLOCK))
        steps.append(0.51 * padded.view(padded.shape[0], -1, ACTIVATION_BLOCK).sum(-1).amax(-1).double())
    del exact
    bound = torch.stack([torch.cat(weights), torch.cat(steps)]) * (1 + 2.0 ** -10)
    bound32 = bound.float()
    bound32 = torch.where(bound32.double() < bound, torch.nextafter(bound32, torch.tensor(float("inf"))), bound32)
    copy = WeightOnlyLinear.from_int8(q)
    copy.enable_kernels(kernels)
    coarse = copy.kernel_weight()
    logger.info("LM head: greedy steps read an int8 copy (%.1f MiB) and the exact rows they need",
                copy.nbytes / 2**20)
    return ScreenedHead(coarse, bound32.contiguous(), copy)


SCREEN_ATTRIBUTE = "_greedy_screen"  # on the head module; not a submodule, so out of the model's bytes


def screen_for(head: torch.nn.Module, kernels: Any) -> ScreenedHead | None:
    """`head`'s screen, made on first use and kept on the module (None: none applies)."""
    screen = head.__dict__.get(SCREEN_ATTRIBUTE, False)
    if screen is False:
        screen = build_screened_head(head, kernels)
        head.__dict__[SCREEN_ATTRIBUTE] = screen
    return screen


def drop_screen(head: torch.nn.Module) -> None:
    """Forget `head`'s copy for good: its weights were written (weight sync), and a copy rebuilt on
    every update would cost more than it saves on a model that is being trained."""
    head.__dict__[SCREEN_ATTRIBUTE] = None


def greedy_bytes_saved(head: torch.nn.Module) -> int:
    """Bytes a screened greedy forward does not read from `head` (its weight's against the copy's;
    the few exact blocks it reads are left out), 0 without a copy: for benchmarks that divide the
    bytes a step reads by its time."""
    screen = head.__dict__.get(SCREEN_ATTRIBUTE)
    if not screen:
        return 0
    return int(head.nbytes) - int(screen.copy.nbytes)
