"""Device and dtype choice, and how much memory is free for the KV cache."""

from __future__ import annotations

import os

import torch

from kvik.core.errors import ConfigError


def select_device(name: str) -> torch.device:
    """auto: the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device: {name!r} requested but torch sees no CUDA device "
                          f"(torch {torch.__version__}); use --device cpu")
    return torch.device(name)


# The model dtypes by the names --dtype takes (kvik.core.config.DTYPES, less "auto").
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def select_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on GPUs that support it (float16 on older ones), float32 on the CPU, where
    half-precision matmuls are slower and less accurate."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return TORCH_DTYPES[name]


def free_memory_bytes(device: torch.device) -> int:
    """Memory that can still be allocated on the device now."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def default_kv_fraction(device: torch.device) -> float:
    # A GPU is dedicated to serving; a CPU host also runs everything else.
    return 0.9 if device.type == "cuda" else 0.25
