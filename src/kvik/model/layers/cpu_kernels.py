"""Optional C++ kernels for the CPU path, compiled on first use with torch's extension builder.

Paged decode attention reads keys and values straight from the block pool, where the plain PyTorch
path must first gather every sequence's blocks into a padded copy (three passes over the KV bytes
instead of one, and padding to the longest sequence). If no compiler is available, or
KVIK_CPU_KERNELS=0, the PyTorch path is used and results are the same.
"""

from __future__ import annotations

import logging
import os
import threading
from importlib import resources
from pathlib import Path
from typing import Any

logger = logging.getLogger("kvik.model")

_lock = threading.Lock()
_module: Any = None
_tried = False


def _cpu_fingerprint() -> str:
    """Built with -march=native: a cache shared between different CPUs must not mix binaries."""
    import hashlib
    import platform

    flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags += next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


def _build_dir() -> Path:
    root = os.environ.get("KVIK_CACHE_DIR") or Path.home() / ".cache" / "kvik"
    path = Path(root) / "torch_extensions"
    path.mkdir(parents=True, exist_ok=True)
    return path


def cpu_attention_kernels() -> Any:
    """The compiled module, or None when disabled or unavailable (logged once)."""
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get("KVIK_CPU_KERNELS", "1") == "0":
            return None
        try:
            from torch.utils.cpp_extension import load

            source = resources.files("kvik.model.layers").joinpath("csrc/paged_attention_cpu.cpp")
            _module = load(name=f"kvik_paged_attention_cpu_{_cpu_fingerprint()}", sources=[str(source)],
                           extra_cflags=["-O3", "-march=native", "-fopenmp"],
                           extra_ldflags=["-fopenmp"], build_directory=str(_build_dir()), verbose=False)
        except Exception as exc:  # no compiler, no ninja, unsupported platform
            logger.warning("CPU attention kernel unavailable, using the PyTorch path (%s)", exc)
            _module = None
    return _module
