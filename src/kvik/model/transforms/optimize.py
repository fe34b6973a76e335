"""The one entry point for inference passes over a loaded model, and the KV cache binding after it.

    report = optimize_for_inference(model, device, dtype, weights=QuantScheme("int8"))
    ...allocate the KV cache (its size may depend on report.weight_bytes)...
    bind_kv_cache(model, kv_cache)

`optimize_for_inference` runs, in order: weight-only quantization (bfloat16 / int8 / int4 storage,
any device), oneDNN packing of the remaining float32 CPU linears, and on CPU float32 models the swap
of norms, attention, MLP and paged attention for modules that call kvik's compiled kernels.
`bind_kv_cache` gives every attention layer its view of the cache and, for Llama-family models on
the compiled path, wraps the body in the decode stack. The model files know nothing of any of it;
KVIK_CPU_KERNELS=0 keeps plain PyTorch (and no oneDNN packing) with the same outputs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kvik.model.layers.attention import PagedAttention
from kvik.model.layers.cpu_kernels import cpu_kernels
from kvik.model.layers.kv_cache import PagedKVCache
from kvik.model.quant.linear import WeightOnlyLinear
from kvik.model.quant.quantize import quantize_model
from kvik.model.quant.scheme import QuantScheme, cpu_has_native_bf16
from kvik.model.transforms.cpu_modules import CpuPagedAttention, swap_cpu_modules
from kvik.model.huge_pages import move_to_huge_pages
from kvik.model.transforms.decode_stack import unwrap_decode_stack, wrap_decode_stack
from kvik.model.transforms.onednn_linear import OneDNNLinear, onednn_available, pack_linears_for_onednn
from kvik.model.transforms.prefetch import PrefetchChoice, tune_weight_prefetch

logger = logging.getLogger("kvik.model")

AUTO = "auto"


@dataclass(slots=True)
class TransformReport:
    """What optimize_for_inference did to a model."""

    device: str
    compute_dtype: str
    weights: str  # "float32", "bfloat16", "int8", "int4 (groups of 64, symmetric; LM head int8)"
    kernels: Any = None  # the compiled CPU kernel module in use, or None
    kernel_isa: str | None = None  # vector instructions the kernels were built for ("avx2", "avx512")
    quantized_linears: int = 0
    packed_linears: int = 0  # float32 linears on oneDNN's packed weights
    small_batch_linears: int = 0  # linears with a compiled 1-4 row kernel (the decode stack needs all)
    swapped_modules: int = 0  # norms, attention, MLPs, paged attention on compiled kernels
    weight_bytes: int = 0  # every parameter and buffer of the model after the passes
    linear_weight_bytes: int = 0  # what one decode step streams: all linear layers' weights
    linear_weights: int = 0  # elements of those weights (in x out each); bytes per weight = the ratio
    int8_activation_linears: int = 0  # int8/int4 linears multiplying int8-rounded activations (VNNI)
    bf16_activation_linears: int = 0  # bfloat16 linears multiplying batches of 12+ rows in bfloat16
    huge_page_bytes: int = 0  # weights copied into memory advised for transparent huge pages (CPU)
    weight_prefetch: PrefetchChoice | None = None  # the weight-only kernels' prefetch distance (CPU)
    notes: list[str] = field(default_factory=list)


@dataclass(slots=True)
class CacheBinding:
    """What bind_kv_cache did."""

    attention_layers: int
    compiled_attention: bool  # decode attention reads the cache with the compiled kernel
    decode_stack: bool  # steps of 1-4 decodes run all layers in one compiled call


def optimize_for_inference(model: nn.Module, device: torch.device, dtype: torch.dtype, *,
                           weights: QuantScheme | None = None, kernels: Any = AUTO,
                           bf16_gemm: bool | None = None, int8_activations: bool = True) -> TransformReport:
    """Apply kvik's inference passes to a loaded `model` on `device` computing in `dtype`, before the
    KV cache exists. `weights`: narrow storage for the linear layers (None keeps `dtype`).
    `kernels`: the compiled CPU kernel module, None for plain PyTorch, or "auto" (compiled on CPU
    float32 unless KVIK_CPU_KERNELS=0). `bf16_gemm`: bfloat16 weights multiply batches of 12+ rows
    (prompts, busy decode steps) on bfloat16-rounded inputs (default: where the CPU has bfloat16
    arithmetic; False keeps them on float32 inputs). `int8_activations`: int8 and int4 layers may
    take activations rounded to int8 (AVX512-VNNI CPUs; kvik.model.quant.linear)."""
    name = str(dtype).removeprefix("torch.")
    report = TransformReport(str(device), name, weights.describe() if weights else name)
    loaded_kinds = sorted({m.kind for m in model.modules() if isinstance(m, WeightOnlyLinear)})
    if loaded_kinds:  # a pre-quantized checkpoint's layers, kept as the loader built them
        report.weights = f"{'/'.join(loaded_kinds)} as loaded from the checkpoint, other linears {report.weights}"
    enabled = os.environ.get("KVIK_CPU_KERNELS", "1") != "0"
    cpu_float32 = device.type == "cpu" and dtype == torch.float32
    if kernels == AUTO:
        kernels = cpu_kernels() if cpu_float32 and enabled else None
    elif not cpu_float32:
        kernels = None
    report.kernels = kernels
    if kernels is not None and hasattr(kernels, "simd_isa"):
        report.kernel_isa = kernels.simd_isa()
    native = cpu_has_native_bf16() if bf16_gemm is None else bf16_gemm
    if weights is not None:
        report.quantized_linears = quantize_model(model, weights, kernels, bf16_gemm=native)
    # Layers a loader built already quantized (GGUF, GPTQ, AWQ) get the kernels too.
    for module in model.modules():
        if isinstance(module, WeightOnlyLinear) and module.kernel_weight() is None and kernels is not None:
            module.enable_kernels(kernels, bf16_gemm=native and module.kind == "bfloat16")
            report.quantized_linears += 1
    if cpu_float32 and enabled and onednn_available():
        report.packed_linears, report.small_batch_linears = pack_linears_for_onednn(model, kernels)
    if kernels is not None:
        report.small_batch_linears += report.quantized_linears
        report.swapped_modules = swap_cpu_modules(model, kernels)
    elif device.type == "cpu" and weights is not None:
        report.notes.append("no compiled kernels: quantized weights are dequantized by PyTorch ops")
    for module in model.modules():
        if isinstance(module, WeightOnlyLinear) and module.kernel_weight() is not None:
            module.kernel_weight().allow_int8_activations = int8_activations
    report.int8_activation_linears = sum(
        1 for m in model.modules()
        if isinstance(m, WeightOnlyLinear) and m.kernel_weight() is not None and m.kernel_weight().int8_activations())
    report.bf16_activation_linears = sum(
        1 for m in model.modules()
        if isinstance(m, WeightOnlyLinear) and m.kernel_weight() is not None and m.kernel_weight().bf16_prompt_tiles())
    if device.type == "cpu" and os.environ.get("KVIK_HUGE_PAGES", "1") != "0":
        # Last: every pass above may have replaced weights (packing, quantization).
        report.huge_page_bytes = move_to_huge_pages(model)
    if device.type == "cpu":
        # After the move: the pages under the weights are part of what the distance is tuned to.
        report.weight_prefetch = tune_weight_prefetch(model, kernels)
    report.weight_bytes = _model_bytes(model)
    report.linear_weight_bytes = _linear_bytes(model)
    report.linear_weights = sum(m.in_features * m.out_features for m in model.modules()
                                if isinstance(m, (WeightOnlyLinear, OneDNNLinear, nn.Linear)))
    logger.info("inference passes: weights %s (%.1f MiB, %.1f MiB in linear layers, %.1f MiB on huge pages), "
                "kernels %s, %d modules swapped", report.weights, report.weight_bytes / 2**20,
                report.linear_weight_bytes / 2**20, report.huge_page_bytes / 2**20, report.kernel_isa or "off",
                report.swapped_modules)
    if report.weight_prefetch is not None:
        logger.info("weight prefetch distance: %s", report.weight_prefetch.describe())
    return report


def bind_kv_cache(model: nn.Module, kv_cache: PagedKVCache) -> CacheBinding:
    """Give every attention layer of `model` its view of `kv_cache` (all layers, as allocated by
    PagedKVCache.empty), and enable the compiled decode stack where it applies."""
    unwrap_decode_stack(model)
    layers: list[PagedAttention] = model.attention_layers()
    if kv_cache.data.shape[0] != len(layers):
        raise ValueError(f"KV cache has {kv_cache.data.shape[0]} layers, the model {len(layers)}")
    for index, attention in enumerate(layers):
        attention.kv_cache = kv_cache.layer(index)
    compiled = bool(layers) and all(isinstance(a, CpuPagedAttention) for a in layers)
    stack = compiled and wrap_decode_stack(model)
    return CacheBinding(len(layers), compiled, stack)


def _model_bytes(model: nn.Module) -> int:
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    # oneDNN's packed weights are opaque tensors, neither parameters nor buffers.
    return total + sum(torch.ops.mkldnn._nbytes(m.packed) for m in model.modules() if isinstance(m, OneDNNLinear))


def _linear_bytes(model: nn.Module) -> int:
    total = 0
    for module in model.modules():
        if isinstance(module, (WeightOnlyLinear, OneDNNLinear)):
            total += module.nbytes
        elif isinstance(module, nn.Linear):
            total += sum(t.numel() * t.element_size() for t in module.parameters())
    return total
