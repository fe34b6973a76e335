"""Copy checkpoint tensors into a model's parameters, including fused ones.

Models fuse projections that run on the same input (q/k/v into `qkv_proj`, gate/up into
`gate_up_proj`) to launch one matmul instead of several. A `WeightLoader` routes each checkpoint
tensor to its parameter, or to a row slice of a fused parameter, and at the end reports every
checkpoint tensor that was never seen, by its checkpoint name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from kvik.core.errors import MissingWeightsError


@dataclass(frozen=True, slots=True)
class FusedPiece:
    """Checkpoint tensor `<prefix>.<source>.<suffix>` fills rows [start, start + size) of
    `<prefix>.<target>.<suffix>`."""

    source: str
    target: str
    start: int
    size: int


class WeightLoader:
    def __init__(self, model: nn.Module, fused: list[FusedPiece],
                 transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> None:
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.fused = {piece.source: piece for piece in fused}
        self.pieces_of: dict[str, list[FusedPiece]] = {}
        for piece in fused:
            self.pieces_of.setdefault(piece.target, []).append(piece)
        self.transform = transform
        # Expected checkpoint names, removed as they arrive.
        self.missing: set[str] = set()
        for name in self.params:
            module_path, _, leaf = name.rpartition(".")
            parent, _, attr = module_path.rpartition(".")
            pieces = self.pieces_of.get(attr)
            if pieces:
                self.missing.update(f"{parent}.{p.source}.{leaf}" for p in pieces)
            else:
                self.missing.add(name)

    def ignore(self, names: Iterable[str]) -> None:
        """Parameters that need no checkpoint tensor (tied weights)."""
        self.missing.difference_update(names)

    def load(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy one checkpoint tensor; False when the model has no place for it."""
        if self.transform is not None:
            tensor = self.transform(name, tensor)
        module_path, _, leaf = name.rpartition(".")
        parent, _, attr = module_path.rpartition(".")
        piece = self.fused.get(attr)
        if piece is not None:
            target = f"{parent}.{piece.target}.{leaf}"
            param = self.params.get(target)
            if param is None:
                return False
            destination = param.data[piece.start:piece.start + piece.size]
        else:
            param = self.params.get(name)
            if param is None:
                return False
            destination = param.data
        if destination.shape != tensor.shape:
            raise MissingWeightsError(
                f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, but the model built from "
                f"config.json expects {tuple(destination.shape)}; the config and weights disagree")
        destination.copy_(tensor)
        self.missing.discard(name)
        return True

    def finish(self, checkpoint_desc: str) -> None:
        if self.missing:
            names = sorted(self.missing)
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            raise MissingWeightsError(f"{checkpoint_desc} lacks {len(names)} tensor(s) the model "
                                      f"needs: {shown}")
