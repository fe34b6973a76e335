"""How much memory a model will take once loaded, known before loading it (the server never imports
torch, so this reads the safetensors headers: an 8-byte length, then JSON naming each tensor's
dtype and shape).

Footprint = weights in the dtype the engine will use + the KV cache budget. An estimate only until
the model has been loaded once; then the engine reports the exact figures (`EngineInfo`).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from kvik.core.config import EngineArgs
from kvik.core.errors import ConfigError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# `dtype: auto` is float32 on CPU and 16-bit on CUDA; the server cannot tell which device the engine
# will pick without importing torch, so it assumes the larger (the estimate errs on the safe side).
AUTO_DTYPE_BYTES = 4
_MAX_HEADER_BYTES = 100 * 2**20


def weight_elements(model_dir: Path) -> int:
    """Number of weight elements in the directory's safetensors files."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir}: no safetensors weights found (models served side by side must "
                          "be local directories)")
    total = 0
    for path in files:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > _MAX_HEADER_BYTES:
                raise ConfigError(f"{path}: not a safetensors file (header of {length} bytes)")
            header = json.loads(handle.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                total += math.prod(entry["shape"])
    return total


def estimate_footprint(args: EngineArgs) -> int:
    """Bytes the model will hold once loaded: weights plus the KV cache budget."""
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise ConfigError(f"{args.model}: models served side by side must be local model directories")
    element_bytes = DTYPE_BYTES.get(args.dtype, AUTO_DTYPE_BYTES)
    return weight_elements(model_dir) * element_bytes + (args.kv_cache_memory or 0)
