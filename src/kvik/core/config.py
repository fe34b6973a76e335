"""Engine configuration: one dataclass of user-facing arguments, validated once.

`EngineArgs` is what `LLM(model=..., **engine_args)` and the `kvik serve` flags fill in. The engine
resolves the values that depend on the model or the hardware (`max_model_len`, the device, the dtype,
the number of KV blocks) at start-up and records them on itself.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields
from typing import Any

from kvik.core.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(slots=True)
class EngineArgs:
    model: str
    tokenizer: str | None = None  # defaults to the model's directory
    revision: str | None = None  # hub revision when `model` is a hub id
    device: str = "auto"  # auto: CUDA when available, else CPU
    dtype: str = "auto"  # auto: bfloat16 (float16 without bf16 support) on CUDA, float32 on CPU
    seed: int = 0
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    block_size: int = 16  # tokens per KV block
    # KV cache budget: bytes when set, else this fraction of free device memory (after the weights).
    kv_cache_memory: int | None = None
    kv_cache_fraction: float | None = None
    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int | None = None  # per-step token budget; default 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    threads: int | None = None  # CPU intra-op threads; default: torch's choice
    show_progress: bool = True  # progress bar while loading weights
    # fcfs: arrival order. priority: requests' `priority` tiers, then fair share between tenants.
    scheduling_policy: str = "priority"

    def __post_init__(self) -> None:
        if isinstance(self.kv_cache_memory, str):  # the Python API takes the CLI's sizes too
            try:
                self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
            except argparse.ArgumentTypeError as exc:
                raise ConfigError(f"kv_cache_memory: {exc}") from None
        self.validate()

    def validate(self) -> None:
        for name, expected in _FIELD_TYPES.items():
            value = getattr(self, name)
            if value is None:
                continue
            # bool is an int to Python, never to a user: max_num_seqs=True is a mistake.
            if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
                raise ConfigError(f"{name}: expected {_TYPE_NAMES.get(expected, 'a number')}, "
                                  f"got {type(value).__name__} {value!r}")
        if not self.model:
            raise ConfigError("model: give a local model directory or a hub id")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ConfigError(f"device: {self.device!r} is not one of {', '.join(DEVICES)} or cuda:N")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ConfigError(f"block_size: {self.block_size} must be a power of two up to 128")
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "kv_cache_memory",
                     "threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name}: must be at least 1, got {value}")
        if self.kv_cache_fraction is not None and not 0 < self.kv_cache_fraction <= 1:
            raise ConfigError(f"kv_cache_fraction: must be in (0, 1], got {self.kv_cache_fraction}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy: {self.scheduling_policy!r} is not one of "
                              f"{', '.join(SCHEDULING_POLICIES)}")
        if self.kv_cache_memory is not None and self.kv_cache_fraction is not None:
            raise ConfigError("kv_cache_memory and kv_cache_fraction: give one, not both")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(known))}")
        return cls(model=model, **kwargs)

    # -- command-line integration, shared by `kvik serve`, `kvik generate` and `kvik bench` --

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *, model_required: bool = False,
                     several_models: bool = False) -> None:
        group = parser.add_argument_group("engine")
        model_help = "model directory in HF format (GPTQ/AWQ included), a .gguf file, or a hub id to download"
        if several_models:  # `kvik serve`: --model NAME=PATH, repeated, serves several models
            group.add_argument("--model", required=model_required, default=None, action="append",
                               help=model_help + "; repeat as --model NAME=PATH to serve several models, "
                                                 "loaded on demand")
        else:
            group.add_argument("--model", required=model_required, default=None, help=model_help)
        group.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
        group.add_argument("--revision", default=None, help="hub revision for a hub id")
        group.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
        group.add_argument("--dtype", default="auto", choices=DTYPES,
                           help="weights and KV dtype (default: auto: bfloat16 on CUDA, float32 on CPU)")
        group.add_argument("--seed", type=int, default=0, help="seed for requests without their own")
        group.add_argument("--max-model-len", type=int, default=None,
                           help="context length (default: the model's max_position_embeddings)")
        group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
        group.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                           help="KV cache budget in bytes; suffixes KiB/MiB/GiB/KB/MB/GB accepted")
        group.add_argument("--kv-cache-fraction", type=float, default=None,
                           help="KV cache budget as a fraction of free device memory after the weights "
                                "(default: 0.9 on CUDA, 0.25 of available RAM on CPU)")
        group.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step")
        group.add_argument("--max-num-batched-tokens", type=int, default=None,
                           help="token budget per step (default: 2048; with --no-chunked-prefill "
                                "at least max-model-len)")
        group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                           help="disable automatic prefix caching")
        group.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                           help="schedule each prompt whole (needs a token budget >= max-model-len)")
        group.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
        group.add_argument("--scheduling-policy", default="priority", choices=SCHEDULING_POLICIES,
                           help="priority (default): requests' `priority` first (lower is served "
                                "first; better tiers preempt worse ones), then fair share of tokens "
                                "between tenants; fcfs: arrival order only")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, default_model: str | None = None) -> EngineArgs:
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if not values.get("model"):
            values["model"] = default_model
        return cls(**values)


# What each field must hold, so a wrong type is a ConfigError naming the field, not a TypeError from
# deep inside validation.
_FIELD_TYPES: dict[str, Any] = {
    "model": str, "tokenizer": str, "revision": str, "device": str, "dtype": str, "seed": int,
    "max_model_len": int, "block_size": int, "kv_cache_memory": int, "kv_cache_fraction": (int, float),
    "max_num_seqs": int, "max_num_batched_tokens": int, "enable_prefix_caching": bool,
    "enable_chunked_prefill": bool, "threads": int, "show_progress": bool, "scheduling_policy": str,
}
_TYPE_NAMES = {str: "a string", int: "an integer", bool: "true or false"}

_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "ki": 1024, "kib": 1024, "mi": 1024**2,
          "mib": 1024**2, "gi": 1024**3, "gib": 1024**3, "ti": 1024**4, "tib": 1024**4}


def parse_bytes(text: str) -> int:
    """'512MiB' -> 536870912; a plain number is bytes."""
    match = _BYTES.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 2GiB, 512MB or 1048576")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "").lower()])
