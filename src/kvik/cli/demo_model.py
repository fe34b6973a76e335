"""The built-in demo model: what `kvik serve` and `kvik generate` use when no --model is given.

The Shakespeare model trained by `kvik train demo` when one exists (it speaks something like
English), else a small random-weight Llama written once by make-model into the cache folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("KVIK_CACHE_DIR") or Path.home() / ".cache" / "kvik"
    return Path(root)


def demo_model_path() -> str:
    try:
        from kvik.train.demo import trained_demo_model_path

        trained = trained_demo_model_path()
    except ImportError:  # training extras not installed
        trained = None
    if trained is not None:
        return str(trained)
    target = cache_dir() / "demo-llama-small"
    if not (target / "config.json").is_file():
        from kvik.model.make_model import make_model

        print(f"writing the built-in demo model (random weights) to {target} ...", flush=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        # Write beside the target and rename, so two processes starting at once never see a
        # half-written model.
        scratch = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
        make_model(scratch, "llama", "small")
        try:
            scratch.rename(target)
        except OSError:  # another process won the race
            shutil.rmtree(scratch, ignore_errors=True)
    return str(target)
