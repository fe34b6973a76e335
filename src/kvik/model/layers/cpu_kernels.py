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


def _fingerprint(source: bytes) -> str:
    """Names a build: the source, torch's version, and the CPU (it is built with -march=native, so
    a cache shared between different machines must not mix binaries)."""
    import hashlib
    import platform

    import torch

    digest = hashlib.sha256(source + torch.__version__.encode() + platform.machine().encode())
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            digest.update(next((line for line in cpuinfo if line.startswith("flags")), "").encode())
    except OSError:
        pass
    return digest.hexdigest()[:12]


def _staged_source() -> tuple[str, Path]:
    """Copy the kernel source into a build directory named by its fingerprint. Every checkout then
    compiles the same path in the same place, so ninja finds the build up to date instead of
    rebuilding whenever another checkout's path was used last."""
    source = resources.files("kvik.model.layers").joinpath("csrc/paged_attention_cpu.cpp").read_bytes()
    root = os.environ.get("KVIK_CACHE_DIR") or Path.home() / ".cache" / "kvik"
    name = f"kvik_paged_attention_cpu_{_fingerprint(source)}"
    build_dir = Path(root) / "torch_extensions" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    staged = build_dir / "paged_attention_cpu.cpp"
    if not staged.is_file() or staged.read_bytes() != source:
        scratch = build_dir / f".paged_attention_cpu.{os.getpid()}.cpp"
        scratch.write_bytes(source)
        scratch.replace(staged)  # atomic: a concurrent build never sees half a file
    return name, staged


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

            name, source = _staged_source()
            _module = load(name=name, sources=[str(source)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                           extra_ldflags=["-fopenmp"], build_directory=str(source.parent), verbose=False)
        except Exception as exc:  # no compiler, no ninja, unsupported platform
            logger.warning("CPU attention kernel unavailable, using the PyTorch path (%s)", exc)
            _module = None
    return _module
