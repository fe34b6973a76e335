"""Model FLOPs utilisation: achieved training FLOP/s over the device's peak.

Training FLOPs per token follow the PaLM paper (Chowdhery et al. 2022, appendix B):
6 * N for the matrix multiplies of forward and backward over the N parameters used as matrices
(all but the input embedding, which is a lookup; a tied output projection counts), plus
12 * layers * hidden * seq_len for attention scores and values.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

# Dense bf16 tensor-core peak per GPU, from the vendors' data sheets (no sparsity).
GPU_PEAK_BF16 = {
    "H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12,
    "L40S": 362e12, "L4": 121e12, "A10G": 70e12, "A10": 125e12, "RTX 4090": 165e12,
}


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters that take part in matrix multiplies, for an HF causal LM (before wrapping)."""
    total = sum(p.numel() for p in model.parameters())  # a tied weight is counted once
    inputs = model.get_input_embeddings().weight
    outputs = model.get_output_embeddings()
    tied = outputs is not None and outputs.weight is inputs
    return total - inputs.numel() + (inputs.numel() if tied else 0)


def training_flops_per_token(model_config: Any, num_matmul_params: int, seq_len: int) -> float:
    layers = getattr(model_config, "num_hidden_layers", 0)
    hidden = getattr(model_config, "hidden_size", 0)
    return 6.0 * num_matmul_params + 12.0 * layers * hidden * seq_len


def measure_cpu_peak_flops(size: int = 1024, repeats: int = 8) -> float:
    """fp32 matmul FLOP/s of this machine, best of `repeats`: a CPU has no data-sheet peak that
    torch's threads and vector units would reach, so MFU on CPU is relative to what one large
    matmul achieves (the best run, as neighbours' load only ever slows it down)."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)  # warm-up
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def peak_flops(device: torch.device, override: float | None) -> float | None:
    """Peak FLOP/s of one device: the config's value, a known GPU's, or measured on CPU."""
    if override:
        return override
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((peak for key, peak in GPU_PEAK_BF16.items() if key in name), None)
    return measure_cpu_peak_flops()
