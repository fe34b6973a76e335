"""How far ahead the weight-only decode kernels ask for weight lines, measured on this machine.

A decode step streams every weight once, and the kernels prefetch each weight stream a fixed
distance ahead (prefetcht2). The right distance is a property of the machine and of the pages under
the weights, and no fixed one serves all: on one 2-core AVX-512 machine (4 KiB pages) 4 KiB ahead
ran one-row decodes 1.25-1.45x faster than 1 KiB; on a 2-core AMD Zen 4 with the weights on 2 MiB
pages the same 4 KiB ran them at about 0.7x of 1 KiB or of no software prefetch at all (int8 21 vs
31 GB/s on one thread, 36 vs 51 on two). So at load, for a model whose weight-only linears are large
enough that a pass over them comes from memory (1.5x the last-level cache), kvik times one-row
passes over those weights at a few distances, alternating, and keeps the fastest by median (7 rounds
of 3, 0.1-0.2 s for the 125M reference model; at most about 1 s). The distance changes only when
lines arrive, never a result. KVIK_WEIGHT_PREFETCH=<bytes> sets it instead; it is one
setting per process (the compiled kernels are shared), the last model loaded sets it.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvik.model.quant.linear import WeightOnlyLinear

CANDIDATES = (0, 1024, 4096)  # bytes ahead; 0 leaves the stream to the hardware prefetcher
ROUNDS = 7  # the candidates differ by 5-30 % on a machine whose bandwidth moves more than that
TIME_BUDGET_S = 1.0  # stop after the round that passes this (a large model's pass is long)
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def last_level_cache_bytes() -> int:
    """The largest CPU cache Linux describes for cpu0 (the L3 on most machines), else 32 MiB."""
    largest = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()  # "32768K"
            largest = max(largest, int(text[:-1]) * _UNITS[text[-1]] if text[-1] in _UNITS else int(text))
        except (OSError, ValueError):
            continue
    return largest or 32 * 2**20


def min_tuning_bytes() -> int:
    """Weights smaller than this stay largely in the last-level cache from one pass to the next,
    and a pass that reads cache says nothing about a stream from memory."""
    return last_level_cache_bytes() * 3 // 2


@dataclass(slots=True)
class PrefetchChoice:
    """The distance the weight-only kernels use, and how it was chosen."""

    bytes_ahead: int
    source: str  # "measured", "KVIK_WEIGHT_PREFETCH", or why nothing was measured
    gbps: dict[int, float] = field(default_factory=dict)  # candidate -> median GB/s of its passes

    def describe(self) -> str:
        if not self.gbps:
            return f"{self.bytes_ahead} bytes ({self.source})"
        figures = ", ".join(f"{ahead}: {rate:.1f}" for ahead, rate in self.gbps.items())
        return f"{self.bytes_ahead} bytes ({self.source}; GB/s by distance {figures})"


def tune_weight_prefetch(model: nn.Module, kernels: Any, *, candidates: tuple[int, ...] = CANDIDATES,
                         min_bytes: int | None = None, rounds: int = ROUNDS,
                         time_budget_s: float = TIME_BUDGET_S) -> PrefetchChoice | None:
    """Set the compiled kernels' weight prefetch distance for `model`'s weight-only linears: from
    KVIK_WEIGHT_PREFETCH, else the fastest of `candidates` over one-row passes (median of
    `rounds`). None where the kernels have no such setting or the model has no weight-only
    linears on them; below `min_bytes` (default: min_tuning_bytes()) the kernels' distance is kept
    and reported."""
    if kernels is None or not hasattr(kernels, "set_weight_prefetch_bytes"):
        return None
    layers = [m for m in model.modules() if isinstance(m, WeightOnlyLinear) and m.kernel_weight() is not None]
    if not layers:
        return None
    configured = os.environ.get("KVIK_WEIGHT_PREFETCH", "").strip()
    if configured:
        try:
            kernels.set_weight_prefetch_bytes(int(configured))
        except (ValueError, RuntimeError) as error:
            raise ValueError(f"KVIK_WEIGHT_PREFETCH={configured!r}: give a byte count from 0 to 1048576 "
                             f"({error})") from None
        return PrefetchChoice(int(configured), "KVIK_WEIGHT_PREFETCH")
    total = sum(layer.nbytes for layer in layers)
    if total < (min_tuning_bytes() if min_bytes is None else min_bytes):
        return PrefetchChoice(kernels.weight_prefetch_bytes(),
                              f"kept: {total / 2**20:.0f} MiB of weights would be timed from the cache")
    weights = [layer.kernel_weight() for layer in layers]
    inputs = {n: torch.ones(1, n) for n in {w.in_features for w in weights}}

    def one_pass() -> float:
        start = time.perf_counter()
        for weight in weights:
            weight(inputs[weight.in_features])
        return time.perf_counter() - start

    seconds: dict[int, list[float]] = {ahead: [] for ahead in candidates}
    started = time.perf_counter()
    with torch.inference_mode():
        one_pass()  # first touches: pages, the kernels' per-thread buffers
        for round_index in range(rounds):
            # Rotated order: a candidate is not always the one after the same other one.
            order = candidates[round_index % len(candidates):] + candidates[:round_index % len(candidates)]
            for ahead in order:
                kernels.set_weight_prefetch_bytes(ahead)
                seconds[ahead].append(one_pass())
            if time.perf_counter() - started > time_budget_s:
                break
    medians = {ahead: statistics.median(times) for ahead, times in seconds.items()}
    best = min(candidates, key=lambda ahead: medians[ahead])
    kernels.set_weight_prefetch_bytes(best)
    return PrefetchChoice(best, "measured", {ahead: total / medians[ahead] / 1e9 for ahead in candidates})
