"""The model as the engine serves it: a checkpoint's weights in their serving precision, with the
inference passes' module swaps (quantization, oneDNN packing, the compiled CPU kernels) and the
LoRA slots in place. `EngineCore` builds the KV cache, the runner and the scheduler around it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kvik.core.config import EngineArgs
from kvik.core.errors import ConfigError, KvikError
from kvik.engine.device import select_dtype
from kvik.engine.lora_manager import AdapterManager
from kvik.model.config import ModelConfig
from kvik.model.lora import LoRAModel, enable_lora
from kvik.model.loader import checkpoint_int8_groups, load_model
from kvik.model.quant import Precision, int8_activations, keeps_checkpoint_int4, resolve_precision
from kvik.model.transforms import TransformReport, optimize_for_inference

logger = logging.getLogger("kvik.engine")


@dataclass(slots=True)
class ServedModel:
    model: nn.Module
    precision: Precision  # what runs in which dtype, as it came out of loading and the passes
    weight_bytes: int  # the weights as served, LoRA slots included
    transforms: TransformReport
    adapters: AdapterManager | None  # with --enable-lora
    lora: LoRAModel | None  # the LoRA slots' view of the model, for the runner


def load_served_model(args: EngineArgs, path: Path, cfg: ModelConfig, device: torch.device,
                      tasks: tuple[str, ...]) -> ServedModel:
    quantization, group_size = args.quantization, args.quantization_group_size
    if (quantization is None and args.dtype == "auto" and device.type == "cpu"
            and (q8_groups := checkpoint_int8_groups(path))):
        # A Q8_0 GGUF is served in its own format (exactly: kvik.model.formats.gguf), as a
        # GPTQ/AWQ/Q4 checkpoint keeps its int4 layers under auto. On CUDA, where int8 layers
        # are dequantized by PyTorch ops on every call, it loads as bfloat16 instead.
        quantization, group_size = "int8", q8_groups
        logger.info("%s stores its linear weights as Q8_0: serving them as int8 with a scale per %d "
                    "inputs, the file's own codes and scales (--dtype float32 dequantizes them)",
                    path.name, q8_groups)
    # What runs in which dtype: on the CPU activations stay float32 and --dtype bfloat16 or
    # --quantization narrow the linear weights only (kvik.model.quant.resolve_precision).
    precision = resolve_precision(
        device, select_dtype(args.dtype, device), quantization=quantization, group_size=group_size,
        zero_point=args.quantization_zero_point, kv_cache_dtype=args.kv_cache_dtype)
    dtype = precision.compute_dtype

    started = time.perf_counter()
    loaded = load_model(path, cfg, device, dtype, show_progress=args.show_progress,
                        keep_int4=keeps_checkpoint_int4(args.dtype, args.quantization))
    if loaded.checkpoint_int4 is not None and loaded.checkpoint_int4.layers:
        precision = dataclasses.replace(precision, checkpoint_int4=loaded.checkpoint_int4.describe())
    model = loaded.model
    logger.info("loaded %s (%s, %.1f MiB) on %s as %s in %.1fs", path, cfg.architecture,
                loaded.weight_bytes / 2**20, device, dtype, time.perf_counter() - started)
    # Quantization, oneDNN packing and the compiled CPU kernels, as module swaps.
    transforms = optimize_for_inference(
        model, device, dtype, weights=precision.weights,
        int8_activations=int8_activations(args.activations, args.quantization),
        bf16_gemm=False if args.activations == "float32" else None)
    weight_bytes = transforms.weight_bytes
    precision = dataclasses.replace(precision, int8_activations=transforms.int8_activation_linears > 0,
                                    bf16_activations=transforms.bf16_activation_linears > 0)
    logger.info("precision: %s (%.1f MiB of weights)", precision.describe(), weight_bytes / 2**20)
    # Multi-LoRA serving: the target linears become LoRA-aware wrappers of whatever the passes
    # left (float32, oneDNN-packed or quantized), with --max-loras slots of adapter weights.
    adapters: AdapterManager | None = None
    lora_model: LoRAModel | None = None
    if args.enable_lora:
        if "generate" not in tasks:
            raise ConfigError(f"enable_lora: {cfg.architecture} does not generate text; LoRA adapters "
                              "are served on generative models")
        lora_model = enable_lora(model, args.max_loras, args.max_lora_rank, dtype, device)
        adapters = AdapterManager(lora_model, args.max_cpu_loras)
        weight_bytes += lora_model.nbytes
        logger.info("LoRA: %d slots of rank %d (%.1f MiB)", args.max_loras, args.max_lora_rank,
                    lora_model.nbytes / 2**20)
        for name, lora_path in args.lora_module_pairs():
            try:
                adapters.add(name, lora_path)
            except KvikError as exc:
                raise ConfigError(f"lora_modules: {name}={lora_path}: {exc.message}") from None
    return ServedModel(model, precision, weight_bytes, transforms, adapters, lora_model)
