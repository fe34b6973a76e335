"""Read a PEFT LoRA adapter directory into float32 A/B matrices per target module.

PEFT (and `kvik train`, which uses it) writes `adapter_config.json` and `adapter_model.safetensors`
with tensors named `base_model.model.<module path>.lora_A.weight` (r x in) and `...lora_B.weight`
(out x r). The adapter adds `scale * B @ A` to the module's weight, scale = lora_alpha / r
(lora_alpha / sqrt(r) with rsLoRA). Everything PEFT can express that kvik does not serve (DoRA,
modules_to_save, trained biases, per-module rank patterns, embedding adapters) is refused with a
message that names it, rather than served subtly wrong.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvik.core.errors import LoRAAdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


@dataclass(slots=True)
class LoRAAdapterWeights:
    """One adapter in CPU memory. `weights` maps an HF module path ("model.layers.0.self_attn.q_proj")
    to (A: (r, in), B: (out, r) already multiplied by `scale`), float32."""

    path: str
    rank: int
    scale: float
    target_modules: list[str]
    base_model: str | None = None
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * 4 + b.numel() * 4 for a, b in self.weights.values())


def _read_config(directory: Path) -> dict:
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise LoRAAdapterError(f"lora_path: {directory} has no {CONFIG_FILE}; give a PEFT LoRA adapter "
                               "directory (what `kvik train` with a `lora:` section writes)", param="lora_path")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAAdapterError(f"lora_path: {config_path} is not valid JSON ({exc})", param="lora_path") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"lora_path: {config_path} is not a JSON object", param="lora_path")
    return config


def _check_config(config: dict, directory: Path) -> tuple[int, float]:
    """The adapter's rank and scale, after refusing what kvik does not serve."""
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAAdapterError(f"lora_path: {directory} holds a {peft_type} adapter; only LoRA is served",
                               param="lora_path")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAAdapterError(f"lora_path: adapter_config.json has r={rank!r}; expected a positive integer",
                               param="lora_path")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAAdapterError(f"lora_path: adapter_config.json has lora_alpha={alpha!r}; expected a number",
                               param="lora_path")
    unsupported = {
        "use_dora": "DoRA adapters", "modules_to_save": "modules_to_save (fully trained extra modules)",
        "rank_pattern": "per-module rank_pattern", "alpha_pattern": "per-module alpha_pattern",
        "fan_in_fan_out": "fan_in_fan_out (GPT-2 style Conv1D weights)",
        "layers_to_transform": "layers_to_transform",
    }
    for key, what in unsupported.items():
        if config.get(key):
            raise LoRAAdapterError(f"lora_path: the adapter uses {what}, which kvik does not serve; "
                                   f"retrain without `{key}`", param="lora_path")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError("lora_path: the adapter trains biases (bias != 'none'), which kvik does not "
                               "serve", param="lora_path")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def read_peft_adapter(path: str | Path) -> LoRAAdapterWeights:
    """Load and check an adapter directory; raises LoRAAdapterError naming what to fix."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise LoRAAdapterError(f"lora_path: {path} is not a directory on the server", param="lora_path")
    config = _read_config(directory)
    rank, scale = _check_config(config, directory)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        raise LoRAAdapterError(f"lora_path: {directory} has no {WEIGHTS_FILE} (a pickled adapter_model.bin "
                               "is not loaded; save with safe_serialization=True)", param="lora_path")
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoRAAdapterError(f"lora_path: {weights_path} cannot be read ({exc})", param="lora_path") from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        module, part = _split_name(name)
        halves.setdefault(module, {})[part] = tensor
    adapter = LoRAAdapterWeights(str(directory.resolve()), rank, scale, _targets(config),
                                 config.get("base_model_name_or_path"))
    for module, parts in sorted(halves.items()):
        a, b = parts.get("lora_A"), parts.get("lora_B")
        if a is None or b is None or a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAAdapterError(f"lora_path: module {module} needs lora_A (r x in) and lora_B (out x r) with "
                                   f"r={rank}; found {[(k, tuple(v.shape)) for k, v in parts.items()]}",
                                   param="lora_path")
        adapter.weights[module] = (a.float().contiguous(), (b.float() * scale).contiguous())
    if not adapter.weights:
        raise LoRAAdapterError(f"lora_path: {weights_path} holds no LoRA weights", param="lora_path")
    return adapter


def _split_name(name: str) -> tuple[str, str]:
    """'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' -> ('model.layers.0.self_attn.q_proj',
    'lora_A')."""
    stem = name.removeprefix(PEFT_PREFIX)
    for part in ("lora_A", "lora_B"):
        suffix = f".{part}.weight"
        if stem.endswith(suffix):
            return stem[:-len(suffix)], part
    raise LoRAAdapterError(f"lora_path: tensor {name} is not a LoRA A/B matrix (embedding adapters, "
                           "magnitude vectors and trained biases are not served)", param="lora_path")


def _targets(config: dict) -> list[str]:
    targets = config.get("target_modules") or []
    return sorted(targets) if isinstance(targets, list) else [str(targets)]
