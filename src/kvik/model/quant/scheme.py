"""Which numeric format a model's linear weights are held in, and where the arithmetic happens."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from kvik.core.config import QUANTIZATIONS as QUANTIZATION_METHODS
from kvik.core.errors import ConfigError

from kvik.model.layers.kv_cache import kv_storage_dtype
from kvik.model.quant.reference import DEFAULT_GROUP_SIZES, INT4_GROUP_SIZES, INT8_GROUP_SIZES

logger = logging.getLogger("kvik.model")

WEIGHT_KINDS = ("bfloat16", "int8", "int4")


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """Weight-only storage of every linear layer: bfloat16, int8 per group of inputs (or per output
    channel), or int4 per group.

    The LM head of an int4 model is int8 by default (`lm_head_kind`, groups of 32): it is a single
    matrix whose errors reach every logit directly, and at int8 it costs a few percent more bytes
    per token."""

    kind: str
    # Inputs per scale. None: the format's default, int4 64 and int8 32; int4 takes 32, 64 or 128,
    # int8 those or 0 (a scale per output row).
    group_size: int | None = None
    zero_point: bool = False  # int4: asymmetric, with a zero point per group
    lm_head_kind: str | None = None  # None: int8 for int4 models, else `kind`

    def __post_init__(self) -> None:
        if self.kind not in WEIGHT_KINDS:
            raise ConfigError(f"weight format {self.kind!r} is not one of {', '.join(WEIGHT_KINDS)}")
        if self.group_size is None:
            object.__setattr__(self, "group_size", DEFAULT_GROUP_SIZES.get(self.kind, 0))
        sizes = {"int4": INT4_GROUP_SIZES, "int8": INT8_GROUP_SIZES}.get(self.kind, (0,))
        if self.group_size not in sizes:
            raise ConfigError(f"quantization_group_size: {self.kind} group size {self.group_size} is not one of "
                              f"{sizes}")
        if self.lm_head_kind is not None and self.lm_head_kind not in WEIGHT_KINDS:
            raise ConfigError(f"LM head format {self.lm_head_kind!r} is not one of {', '.join(WEIGHT_KINDS)}")

    def kind_for(self, is_lm_head: bool) -> str:
        if is_lm_head:
            return self.lm_head_kind or ("int8" if self.kind == "int4" else self.kind)
        return self.kind

    def group_for(self, kind: str) -> int:
        """Inputs per scale of a layer stored as `kind` (an int4 model's int8 LM head: int8's default)."""
        if kind == self.kind:
            return self.group_size
        return DEFAULT_GROUP_SIZES["int8"] if kind == "int8" else 0

    def describe(self) -> str:
        if self.kind == "int8":
            return f"int8 (groups of {self.group_size})" if self.group_size else "int8 (per output channel)"
        if self.kind != "int4":
            return self.kind
        zero = "zero points" if self.zero_point else "symmetric"
        return f"int4 (groups of {self.group_size}, {zero}; LM head {self.kind_for(True)})"


@dataclass(frozen=True, slots=True)
class Precision:
    """What a model computes in and stores: activations, linear weights, KV cache."""

    compute_dtype: torch.dtype  # activations, norms, embeddings
    weights: QuantScheme | None  # None: linear weights in compute_dtype
    kv_cache_dtype: torch.dtype
    native_bf16: bool = False  # CPU with bfloat16 dot products (AVX512-BF16 / AMX)
    # Set after loading a pre-quantized checkpoint whose int4 layers were kept (CheckpointInt4.describe);
    # `weights` then applies to the other linear layers.
    checkpoint_int4: str | None = None
    # Set after the inference passes when int8/int4 layers multiply int8-rounded activations
    # (AVX512-VNNI CPUs; kvik.model.quant.linear).
    int8_activations: bool = False
    # Likewise when bfloat16 layers multiply batches of 12+ rows on bfloat16-rounded inputs
    # (AVX512-BF16 CPUs, unless --activations float32).
    bf16_activations: bool = False

    def describe(self) -> str:
        weights = self.weights.describe() if self.weights else str(self.compute_dtype).removeprefix("torch.")
        if self.checkpoint_int4:
            weights = f"{self.checkpoint_int4}, other linear layers {weights}"
        activations = str(self.compute_dtype).removeprefix("torch.")
        if self.int8_activations:
            activations += " (int8 per 32 inputs into the int8/int4 linear layers)"
        if self.bf16_activations:
            activations += " (bfloat16 into the bfloat16 linear layers for batches of 12+ rows)"
        return f"weights {weights}, activations {activations}, KV cache {str(self.kv_cache_dtype).removeprefix('torch.')}"


def keeps_checkpoint_int4(dtype: str, quantization: str | None) -> bool:
    """Whether the 4-bit layers of a pre-quantized checkpoint (GPTQ, AWQ, GGUF Q4_*) are served as int4
    from their own codes: when the user asked for int4, or for no particular format (`--dtype auto`,
    no `--quantization`). An explicit `--dtype` without `--quantization int4`, or `--quantization
    int8`, dequantizes them to float first, then applies the requested format, as for a float model."""
    return quantization == "int4" or (quantization is None and dtype == "auto")


def int8_activations(activations: str, quantization: str | None) -> bool:
    """Whether int8/int4 layers may take int8-rounded activations (`--activations`; they do where the
    CPU has AVX512-VNNI). auto: when the user asked for `--quantization`, kvik's fast path with
    llama.cpp's arithmetic; not for a pre-quantized checkpoint's int4 layers served as they are
    (`--dtype auto`), which then compute what the checkpoint defines, as HF transformers reads it."""
    return activations == "int8" or (activations == "auto" and quantization is not None)


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX-BF16), read from
    /proc/cpuinfo at run time (False where that file does not exist)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_precision(device: torch.device, dtype: torch.dtype, *, quantization: str | None = None,
                      group_size: int | None = None, zero_point: bool = False,
                      kv_cache_dtype: str = "auto") -> Precision:
    """The precision a model runs in on `device` when the user asked for `dtype` and `quantization`.

    On the CPU, activations stay float32 and narrower formats apply to the linear weights only: the
    bytes streamed per token are what bounds decoding, and every CPU can widen bfloat16, int8 and
    int4 to float32 in registers. `--dtype bfloat16` therefore stores bfloat16 weights on any CPU;
    where the CPU has native bfloat16 arithmetic, batches of 12+ rows also multiply in bfloat16
    (the kernel's AVX512-BF16 tiles, or oneDNN's GEMM), and elsewhere in float32 (logged). On CUDA the model computes in `dtype` and quantized weights are
    dequantized by plain PyTorch ops. The KV cache follows `dtype` unless `kv_cache_dtype` says
    otherwise."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ConfigError(f"quantization {quantization!r} is not one of {', '.join(QUANTIZATION_METHODS)}")
    kv_dtype = kv_storage_dtype(kv_cache_dtype, dtype)
    weights = None
    if quantization is not None:
        weights = QuantScheme(quantization, group_size=group_size, zero_point=zero_point)
    compute = dtype
    native = False
    if device.type == "cpu" and dtype == torch.bfloat16:
        compute = torch.float32
        native = cpu_has_native_bf16()
        weights = weights or QuantScheme("bfloat16")
        if native:
            logger.info("bfloat16 on the CPU: weights in bfloat16; batches of 12+ rows (prompts, decode "
                        "steps of 12+ requests) multiply bfloat16-rounded inputs in bfloat16 (the CPU has "
                        "AVX512-BF16/AMX) unless --activations float32; other activations and smaller "
                        "decode steps in float32")
        else:
            logger.info("bfloat16 on the CPU: this CPU has no bfloat16 arithmetic (no avx512_bf16 or "
                        "amx_bf16 in /proc/cpuinfo), so weights are stored in bfloat16 and widened to "
                        "float32 in registers; all arithmetic is float32")
    return Precision(compute, weights, kv_dtype, native)
