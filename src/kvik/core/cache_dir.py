"""Where kvik keeps files it derives once and reuses: compiled kernels, converted tokenizers, demo
models."""

from __future__ import annotations

import os
from pathlib import Path


def kvik_cache_dir() -> Path:
    """$KVIK_CACHE_DIR, else ~/.cache/kvik."""
    return Path(os.environ.get("KVIK_CACHE_DIR") or Path.home() / ".cache" / "kvik")
