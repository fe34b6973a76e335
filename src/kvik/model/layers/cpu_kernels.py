"""Optional C++ kernels for the CPU path, compiled on first use with torch's extension builder.

Paged decode attention reads keys and values straight from the block pool, where the plain PyTorch
path must first gather every sequence's blocks into a padded copy (three passes over the KV bytes
instead of one, and padding to the longest sequence). Fused norm, rotary and SiLU kernels replace
chains of small ops (csrc/fused_ops_cpu.cpp). A matrix-vector kernel reads oneDNN's packed weights
for decodes of 1-4 rows (csrc/gemv_cpu.cpp), and for such steps a Llama-family model runs all its
layers in one call (csrc/decode_stack_cpu.cpp). If no compiler is available, or
KVIK_CPU_KERNELS=0 (which also turns off oneDNN weight packing), the PyTorch path is used and results
are the same.
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


SOURCES = ("paged_attention_cpu.cpp", "fused_ops_cpu.cpp", "gemv_cpu.cpp", "weight_only_cpu.cpp",
           "decode_stack_cpu.cpp")
HEADERS = ("kernels.h",)


def _staged_sources() -> tuple[str, list[Path]]:
    """Copy the kernel sources into a build directory named by their fingerprint. Every checkout
    then compiles the same paths in the same place, so ninja finds the build up to date instead of
    rebuilding whenever another checkout's path was used last."""
    package = resources.files("kvik.model.layers").joinpath("csrc")
    sources = {name: package.joinpath(name).read_bytes() for name in SOURCES + HEADERS}
    root = os.environ.get("KVIK_CACHE_DIR") or Path.home() / ".cache" / "kvik"
    name = f"kvik_cpu_kernels_{_fingerprint(b''.join(sources.values()))}"
    build_dir = Path(root) / "torch_extensions" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    staged = []
    for file_name, content in sources.items():
        target = build_dir / file_name
        if not target.is_file() or target.read_bytes() != content:
            scratch = build_dir / f".{file_name}.{os.getpid()}"
            scratch.write_bytes(content)
            scratch.replace(target)  # atomic: a concurrent build never sees half a file
        if file_name in SOURCES:
            staged.append(target)
    return name, staged


def cpu_kernels() -> Any:
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

            name, sources = _staged_sources()
            if not (sources[0].parent / f"{name}.so").is_file():
                logger.info("compiling kvik's CPU kernels (first run on this machine, about 30 s) ...")
            # -ffast-math lets GCC vectorise expf through glibc's vector math library; the kernels
            # never rely on infinities or NaNs (softmax subtracts the row maximum first).
            _module = load(name=name, sources=[str(s) for s in sources],
                           extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                           extra_ldflags=["-fopenmp"], build_directory=str(sources[0].parent),
                           verbose=False)
        except Exception as exc:  # no compiler, no ninja, unsupported platform
            logger.warning("CPU kernels unavailable, using the PyTorch path (%s)", exc)
            _module = None
    return _module
