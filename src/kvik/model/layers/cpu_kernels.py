"""Optional C++ kernels for the CPU path, compiled on first use with torch's extension builder.

Paged decode attention reads keys and values straight from the block pool, where the plain PyTorch
path must first gather every sequence's blocks into a padded copy (three passes over the KV bytes
instead of one, and padding to the longest sequence). Fused norm, rotary and SiLU kernels replace
chains of small ops (csrc/fused_ops_cpu.cpp). A matrix-vector kernel reads oneDNN's packed weights
for decodes of 1-4 rows (csrc/gemv_cpu.cpp), and for such steps a Llama-family model runs all its
layers in one call (csrc/decode_stack_cpu.cpp). If no compiler is available, or
KVIK_CPU_KERNELS=0 (which also turns off oneDNN weight packing), the PyTorch path is used and results
are the same (int8/int4 weights: up to the int8 rounding of activations on AVX512-VNNI CPUs, see
csrc/weight_only_cpu.cpp).
"""

from __future__ import annotations

import logging
import os
import threading
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from kvik.core.cache_dir import kvik_cache_dir

logger = logging.getLogger("kvik.model")

_lock = threading.Lock()
_module: Any = None
_tried = False


def _fingerprint(source: bytes) -> str:
    """Names a build: the sources and flags, torch's and Python's versions, and the CPU (it is built
    with -march=native, so a cache shared between different machines must not mix binaries)."""
    import hashlib
    import platform
    import sys

    import torch

    digest = hashlib.sha256(source + torch.__version__.encode() + platform.machine().encode()
                            + sys.implementation.cache_tag.encode())
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            digest.update(next((line for line in cpuinfo if line.startswith("flags")), "").encode())
    except OSError:
        pass
    return digest.hexdigest()[:12]


SOURCES = ("paged_attention_cpu.cpp", "prefill_attention_cpu.cpp", "fused_ops_cpu.cpp", "gemv_cpu.cpp", "weight_only_cpu.cpp",
           "read_bandwidth_cpu.cpp", "decode_stack_cpu.cpp")
HEADERS = ("kernels.h", "decode_team.h")
# -ffast-math lets GCC vectorise expf through glibc's vector math library; the kernels never rely on
# infinities or NaNs (softmax subtracts the row maximum first).


def cflags() -> list[str]:
    """The compiler flags: -march=native (the instruction set of the CPU that builds and runs it),
    or KVIK_CPU_KERNELS_MARCH (e.g. x86-64-v2: no AVX2, the portable loops; for images built on one
    machine and run on others, and to test the portable path on an AVX2 machine)."""
    march = os.environ.get("KVIK_CPU_KERNELS_MARCH") or "native"
    return ["-O3", f"-march={march}", "-fopenmp", "-ffast-math"]


def cache_root() -> Path:
    return kvik_cache_dir() / "torch_extensions"


def _sources() -> tuple[str, dict[str, bytes]]:
    package = resources.files("kvik.model.layers").joinpath("csrc")
    sources = {name: package.joinpath(name).read_bytes() for name in SOURCES + HEADERS}
    return f"kvik_cpu_kernels_{_fingerprint(b''.join(sources.values()) + ' '.join(cflags()).encode())}", sources


def _import_built(name: str, path: Path) -> Any:
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _build(name: str, sources: dict[str, bytes], target: Path) -> Any:
    """Compile in a private directory, then move the library into place in one rename: a build
    that dies half-way (Ctrl-C, kill -9) leaves nothing another process could trip over."""
    import shutil
    import tempfile

    from torch.utils.cpp_extension import load

    scratch = Path(tempfile.mkdtemp(prefix=f".build-{name}-", dir=target.parent))
    try:
        for file_name, content in sources.items():
            (scratch / file_name).write_bytes(content)
        module = load(name=name, sources=[str(scratch / f) for f in SOURCES], extra_cflags=cflags(),
                      extra_ldflags=["-fopenmp"], build_directory=str(scratch), verbose=False)
        os.replace(scratch / f"{name}.so", target)
        return module
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _load_or_build() -> Any:
    """The compiled kernels for these sources on this CPU, built at most once per machine."""
    name, sources = _sources()
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    return build_once(root / f"{name}.so", root / f"{name}.lock",
                      build=lambda target: _build(name, sources, target),
                      load=lambda target: _import_built(name, target))


def build_once(target: Path, lock_path: Path, build: Callable[[Path], Any], load: Callable[[Path], Any]) -> Any:
    """Load `target`, or build it under an exclusive flock first. The kernel releases a flock when
    its holder dies (Ctrl-C, kill -9), unlike torch's own lock file, so a build killed half-way never
    blocks a later start; `build` must put `target` in place atomically. Processes that wait say
    what they are waiting for."""
    import fcntl
    import time

    if target.is_file():
        return load(target)
    with open(lock_path, "a+") as lock:
        waited = 0
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if waited % 15 == 0:
                    lock.seek(0)
                    holder = lock.read().strip() or "another process"
                    logger.info("waiting for %s to finish compiling kvik's CPU kernels (%d s so far)",
                                holder, waited)
                time.sleep(1.0)
                waited += 1
        try:
            if target.is_file():  # built by the process we waited for
                return load(target)
            lock.seek(0)
            lock.truncate()
            lock.write(f"pid {os.getpid()}")
            lock.flush()
            logger.info("compiling kvik's CPU kernels (once per machine and version, about 30 s) ...")
            started = time.perf_counter()
            module = build(target)
            logger.info("compiled kvik's CPU kernels in %.0f s: %s", time.perf_counter() - started, target)
            return module
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


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
            _module = _load_or_build()
        except Exception as exc:  # no compiler, no ninja, unsupported platform
            logger.warning("CPU kernels unavailable, using the PyTorch path (%s)", exc)
            _module = None
        else:
            # KVIK_INT8_ACTIVATIONS=0 keeps int8/int4 layers on float32 activations on AVX512-VNNI
            # CPUs too (weight-only arithmetic, as on every other CPU; slower).
            _module.set_int8_activations(os.environ.get("KVIK_INT8_ACTIVATIONS", "1") != "0")
    return _module
