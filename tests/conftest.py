"""Shared fixtures: tiny random-weight models that kvik writes itself, one per architecture."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gpt2")

# Tests run on 2 cores next to other processes; one torch thread per test process is fastest.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# What `kvik serve` keeps under $XDG_DATA_HOME by default (the Responses store, each port's batch
# database) goes to a directory of this session's own, for the servers the tests start too: never
# into the user's data directory, and never shared with another session's servers.
_DATA_HOME = tempfile.mkdtemp(prefix="kvik-test-data-")
os.environ["XDG_DATA_HOME"] = _DATA_HOME
atexit.register(shutil.rmtree, _DATA_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def model_dir_factory(tmp_path_factory: pytest.TempPathFactory):
    """make(arch, **kwargs) -> Path of a tiny random model, written once per session."""
    from kvik.model.make_model import make_model

    made: dict[tuple, Path] = {}

    def make(arch: str = "llama", size: str = "tiny", **kwargs) -> Path:
        key = (arch, size, tuple(sorted(kwargs.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"{arch}-{size}")
            made[key] = make_model(out, arch, size, **kwargs)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(model_dir_factory) -> Path:
    return model_dir_factory("llama")


@pytest.fixture
def float_activations(monkeypatch):
    """int8 and int4 layers on float32 activations (the weight-only kernels) for this test, also on
    CPUs with AVX512-VNNI, where they otherwise round activations to int8 (with --quantization, or
    --activations int8): for tests that compare with a float reference (HF transformers, plain
    PyTorch) token for token. The rounding itself is tested against its own reference in
    tests/model/test_quant_kernels.py."""
    from kvik.model.layers.cpu_kernels import cpu_kernels

    default = os.environ.get("KVIK_INT8_ACTIVATIONS", "1") != "0"
    monkeypatch.setenv("KVIK_INT8_ACTIVATIONS", "0")  # engine processes started by the test
    kernels = cpu_kernels()
    if kernels is not None:
        kernels.set_int8_activations(False)
    yield
    if kernels is not None:
        kernels.set_int8_activations(default)
