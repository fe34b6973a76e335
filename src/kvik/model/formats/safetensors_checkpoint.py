"""Iterate the tensors of a safetensors checkpoint (one file or shards), plain or pre-quantized.

A GPTQ or AWQ checkpoint (`quantization_config.quant_method` in config.json) stores each quantized
linear as several tensors (`qweight`, `qzeros`, `scales`, ...), possibly in different shards; they are
gathered by module and yielded as one `<module>.weight`: dequantized, so the model loads them like any
float checkpoint, or (`keep_int4`) as a `PrequantizedWeight` the loader turns into an int4 layer.
Everything else (norms, embeddings, unquantized layers, biases) passes through.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol

import torch

from kvik.core.errors import ConfigError, MissingWeightsError
from kvik.model.formats import awq, gptq
from kvik.model.quant.prequantized import PrequantizedWeight


class PackedFormat(Protocol):
    def dequantize(self, name: str, parts: dict[str, torch.Tensor]) -> torch.Tensor: ...

    def prequantized(self, name: str, parts: dict[str, torch.Tensor]) -> PrequantizedWeight: ...


# quant_method -> (format class, every part name, the parts a quantized linear must have)
PACKED_FORMATS: dict[str, tuple[Any, tuple[str, ...], tuple[str, ...]]] = {
    "gptq": (gptq.GPTQFormat, gptq.PARTS, gptq.REQUIRED_PARTS),
    "awq": (awq.AWQFormat, awq.PARTS, awq.REQUIRED_PARTS),
}


class SafetensorsCheckpoint:
    """Every tensor of the given files by name; a context manager that closes the files."""

    def __init__(self, files: list[Path]) -> None:
        from safetensors import safe_open

        self._stack = ExitStack()
        self._handle_of: dict[str, Any] = {}
        self.names: list[str] = []  # in file order, as the files list them
        for file in files:
            handle = self._stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            for name in handle.keys():
                self._handle_of[name] = handle
                self.names.append(name)

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def __contains__(self, name: str) -> bool:
        return name in self._handle_of

    def get(self, name: str) -> torch.Tensor:
        return self._handle_of[name].get_tensor(name)


def packed_format(quantization_config: dict[str, Any]) -> tuple[PackedFormat, tuple[str, ...],
                                                                 tuple[str, ...]]:
    method = str(quantization_config.get("quant_method", "")).lower()
    if method not in PACKED_FORMATS:
        raise ConfigError(f"config.json: quantization_config.quant_method {method!r} is not "
                          f"supported; kvik loads {', '.join(PACKED_FORMATS)} checkpoints and GGUF "
                          "files")
    cls, parts, required = PACKED_FORMATS[method]
    return cls.from_quantization_config(quantization_config), parts, required


def prequantized_names(files: list[Path], quantization_config: dict[str, Any] | None) -> set[str]:
    """`<module>.weight` of every packed linear: what `checkpoint_tensors(keep_int4=True)` yields as
    a PrequantizedWeight (read from the files' headers only)."""
    if not quantization_config:
        return set()
    with SafetensorsCheckpoint(files) as checkpoint:
        return {f"{name.removesuffix('.qweight')}.weight" for name in checkpoint.names
                if name.endswith(".qweight")}


def checkpoint_tensors(files: list[Path], quantization_config: dict[str, Any] | None,
                       skip: Callable[[str], bool], show_progress: bool = True, keep_int4: bool = False,
                       ) -> Iterator[tuple[str, torch.Tensor | PrequantizedWeight]]:
    """(checkpoint name, tensor) for each tensor the model should load, dequantized if packed, or
    with `keep_int4` a PrequantizedWeight for each packed linear."""
    from tqdm import tqdm

    packed = packed_format(quantization_config) if quantization_config else None
    with SafetensorsCheckpoint(files) as checkpoint:
        for name in tqdm(checkpoint.names, desc=f"Loading {files[0].parent.name}", unit="tensor",
                         disable=not show_progress, leave=False):
            if packed is not None:
                fmt, parts, required = packed
                prefix, _, part = name.rpartition(".")
                if part in parts and f"{prefix}.qweight" in checkpoint:
                    if part != "qweight":
                        continue  # read together with its module's qweight
                    if skip(f"{prefix}.weight"):
                        continue
                    found = {p: checkpoint.get(f"{prefix}.{p}") for p in parts
                             if f"{prefix}.{p}" in checkpoint}
                    absent = [p for p in required if p not in found]
                    if absent:
                        raise MissingWeightsError(f"{prefix}: quantized linear lacks "
                                                  f"{', '.join(absent)}")
                    yield f"{prefix}.weight", (fmt.prequantized(prefix, found) if keep_int4
                                               else fmt.dequantize(prefix, found))
                    continue
            if skip(name):
                continue
            yield name, checkpoint.get(name)
