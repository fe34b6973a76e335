"""Find a model (a local directory, a GGUF file, or a hub id), read its config, and load its weights.

The model is built on the meta device, so no memory is spent on random initialisation, then
materialised on the target device and filled tensor by tensor from the checkpoint (single file or
shards listed in `model.safetensors.index.json`, GPTQ/AWQ int4 layers dequantized, or a GGUF file
dequantized; see `kvik.model.formats`), with a progress bar. With `keep_int4`, the 4-bit layers of a
pre-quantized checkpoint become kvik's int4 `WeightOnlyLinear`s from their own codes instead, and
their float weights are never allocated (`kvik.model.weights`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvik.core.errors import ConfigError, MissingWeightsError
from kvik.model.config import ModelConfig, model_config_from_hf
from kvik.model.formats.gguf import (gguf_hf_config, gguf_prequantized_names, gguf_q8_0_linears, gguf_tensors,
                                     is_gguf_file)
from kvik.model.formats.safetensors_checkpoint import checkpoint_tensors, prequantized_names
from kvik.model.models.registry import model_class
from kvik.model.quant.linear import WeightOnlyLinear
from kvik.model.quant.prequantized import CheckpointInt4

logger = logging.getLogger("kvik.model")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    path: Path
    weight_bytes: int  # parameters plus int4 layers' packed buffers, as held after loading
    checkpoint_int4: CheckpointInt4 | None = None  # layers kept as int4 from the checkpoint (keep_int4)


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """A local directory or GGUF file as is; anything else is treated as a hub id and downloaded
    (cached)."""
    local = Path(model).expanduser()
    if local.is_dir() or is_gguf_file(local):
        return local
    if local.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ConfigError(f"model: {model!r} is not a model directory (expected config.json and "
                          "safetensors weights), a .gguf file, nor a hub id like "
                          "'Qwen/Qwen2.5-0.5B-Instruct'")
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(
            repo_id=model, revision=revision,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"],
        )
    except Exception as exc:  # network, auth, or missing repo: all need the user's action
        raise ConfigError(f"model: could not download {model!r} from the hub ({exc}). Check the id, "
                          "the network, and HF_TOKEN for gated models, or pass a local directory")
    return Path(path)


def read_hf_config(path: Path) -> dict[str, Any]:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"model: {path} has no config.json; is it an HF model directory?")
    return json.loads(config_path.read_text())


def load_model_config(path: Path) -> ModelConfig:
    raw = gguf_hf_config(path) if is_gguf_file(path) else read_hf_config(path)
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ConfigError(f"{path}/config.json: field 'architectures' is missing or empty")
    architecture = architectures[0]
    model_class(architecture)  # fails early, naming the supported architectures
    config = model_config_from_hf(raw, architecture)
    generation = path / "generation_config.json"
    if path.is_dir() and generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        if eos is not None:
            extra = [eos] if isinstance(eos, int) else list(eos)
            config.eos_token_ids = list(dict.fromkeys(config.eos_token_ids + extra))
    return config


def checkpoint_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise MissingWeightsError(f"{path}: shards listed in {INDEX_FILE} are missing: "
                                      f"{', '.join(missing)}")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    others = sorted(p.name for p in path.glob("*.safetensors"))
    if others:
        return [path / name for name in others]
    has_bin = any(path.glob("*.bin")) or any(path.glob("*.pt"))
    hint = " (only PyTorch .bin files found; convert them to safetensors)" if has_bin else ""
    raise MissingWeightsError(f"{path}: no safetensors weights found{hint}")


def checkpoint_int8_groups(path: Path) -> int:
    """32 when the checkpoint's linear weights are int8 with a scale per 32 inputs (a GGUF file of
    Q8_0 tensors), which kvik's `--quantization int8 --quantization-group-size 32` holds exactly;
    else 0."""
    return 32 if is_gguf_file(path) and gguf_q8_0_linears(path) else 0


def load_model(path: Path, config: ModelConfig, device: torch.device, dtype: torch.dtype,
               show_progress: bool = True, keep_int4: bool = False) -> LoadedModel:
    """Build the model for `config` on `device` in `dtype` and fill it from the checkpoint at `path`.
    `keep_int4`: serve the 4-bit layers of a GPTQ/AWQ/GGUF checkpoint as int4 from their own codes
    (the rest of the model in `dtype`); without it they are dequantized to `dtype`."""
    cls = model_class(config.architecture)
    with torch.device("meta"):
        model = cls(config)
    model = model.to(dtype=dtype)
    gguf = is_gguf_file(path)
    lazy: set[str] = set()
    if keep_int4:
        meta_loader = model.weight_loader()
        names = (gguf_prequantized_names(path, config.raw, set(meta_loader.missing)) if gguf
                 else prequantized_names(checkpoint_files(path), config.raw.get("quantization_config")))
        lazy = meta_loader.lazy_int4_params(n for n in names if not model.skip_checkpoint_tensor(n))
    _materialize(model, device, lazy)
    model.tie_weights()
    loader = model.weight_loader()
    if keep_int4:
        loader.enable_int4(device)
    if gguf:
        tensors = gguf_tensors(path, config.raw, set(loader.missing), show_progress, keep_int4)
    else:
        tensors = checkpoint_tensors(checkpoint_files(path), config.raw.get("quantization_config"),
                                     model.skip_checkpoint_tensor, show_progress, keep_int4)
    unexpected: list[str] = []
    with torch.no_grad():
        for name, tensor in tensors:
            if model.skip_checkpoint_tensor(name):
                continue
            if not loader.load(model.checkpoint_name(name), tensor):
                unexpected.append(name)
        loader.finish(f"checkpoint {path}")
    if unexpected:
        logger.warning("ignored %d checkpoint tensor(s) the model does not use: %s", len(unexpected),
                       ", ".join(unexpected[:5]))
    weight_bytes = _held_bytes(model)
    model.prepare(device, dtype)
    model.eval()
    int4 = loader.int4 if loader.int4.layers or loader.int4.dequantized else None
    return LoadedModel(model=model, config=config, path=path, weight_bytes=weight_bytes, checkpoint_int4=int4)


def _materialize(model: nn.Module, device: torch.device, lazy: set[str]) -> None:
    """Allocate (uninitialised) every parameter and buffer of a meta-device model on `device`, except
    the parameters named in `lazy`, which stay on the meta device for the weight loader."""
    for module_path, module in model.named_modules():
        keep = {leaf for leaf, _ in module.named_parameters(recurse=False)
                if (f"{module_path}.{leaf}" if module_path else leaf) in lazy}
        if not keep:
            module.to_empty(device=device, recurse=False)
            continue
        for leaf, param in list(module.named_parameters(recurse=False)):
            if leaf not in keep:
                setattr(module, leaf, nn.Parameter(torch.empty_like(param, device=device), param.requires_grad))
        for leaf, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, leaf, torch.empty_like(buffer, device=device))


def _held_bytes(model: nn.Module) -> int:
    """Bytes of the loaded weights: every distinct parameter (tied ones once) and the int4 layers'
    packed codes, scales, offsets and biases."""
    params = {id(p): p for p in model.parameters()}
    return (sum(p.numel() * p.element_size() for p in params.values())
            + sum(m.nbytes for m in model.modules() if isinstance(m, WeightOnlyLinear)))
