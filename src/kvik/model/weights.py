"""Copy checkpoint tensors into a model's parameters, including fused ones.

Models fuse projections that run on the same input (q/k/v into `qkv_proj`, gate/up into
`gate_up_proj`) to launch one matmul instead of several. A `WeightLoader` routes each checkpoint
tensor to its parameter, or to a row slice of a fused parameter, and at the end reports every
checkpoint tensor that was never seen, by its checkpoint name.

Pre-quantized checkpoints (`enable_int4`): a `PrequantizedWeight` aimed at an nn.Linear's weight is
held until every piece of that (possibly fused) module has arrived, the pieces' int4 codes are stacked
along the output rows in piece order, and `finish` swaps the module for a `WeightOnlyLinear` (with the
linear's bias). When the pieces cannot be joined (one is float or not 4-bit, group sizes differ, the
model transforms its checkpoint tensors), the module is loaded as float from each piece's
dequantization, as without int4, and the reason is logged once. A weight the loader may build as
int4 can stay on the meta device until a float write needs it (`lazy_int4_params`), so its float
copy is never allocated.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

from kvik.core.errors import MissingWeightsError
from kvik.model.quant.linear import WeightOnlyLinear
from kvik.model.quant.prequantized import CheckpointInt4, PrequantizedWeight, concat_rows

logger = logging.getLogger("kvik.model")

FLOAT_PIECE = "the checkpoint stores some of their pieces unquantized or in a format without an int4 form"


@dataclass(frozen=True, slots=True)
class FusedPiece:
    """Checkpoint tensor `<prefix>.<source>.<suffix>` fills rows [start, start + size) of
    `<prefix>.<target>.<suffix>`."""

    source: str
    target: str
    start: int
    size: int


@dataclass(slots=True)
class _PendingInt4:
    """The int4 pieces of one linear module received so far, by first output row."""

    expected: int  # pieces the module takes (1 unless fused)
    pieces: dict[int, tuple[str, PrequantizedWeight]] = field(default_factory=dict)


class WeightLoader:
    def __init__(self, model: nn.Module, fused: list[FusedPiece],
                 transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> None:
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.modules = dict(model.named_modules(remove_duplicate=False))
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
        # Pre-quantized checkpoints (enable_int4).
        self.int4_device: torch.device | None = None
        self.int4 = CheckpointInt4()
        self._pending: dict[str, _PendingInt4] = {}  # module path -> int4 pieces so far
        self._ready: dict[str, WeightOnlyLinear] = {}  # module path -> its int4 layer, swapped at finish
        self._float_modules: set[str] = set()  # linear modules that hold (some) float rows
        self._fell_back: set[str] = set()  # of those, the ones with pre-quantized pieces
        self._fallbacks: Counter[str] = Counter()  # reason -> modules
        self._fallback_example: dict[str, str] = {}

    def ignore(self, names: Iterable[str]) -> None:
        """Parameters that need no checkpoint tensor (tied weights)."""
        self.missing.difference_update(names)

    def enable_int4(self, device: torch.device) -> None:
        """Take PrequantizedWeight tensors as int4 layers built on `device` (else they are dequantized)."""
        self.int4_device = device

    def _route(self, name: str) -> tuple[str, FusedPiece | None]:
        """The parameter a checkpoint name fills, and the fused piece (rows) it fills, if any."""
        module_path, _, leaf = name.rpartition(".")
        parent, _, attr = module_path.rpartition(".")
        piece = self.fused.get(attr)
        if piece is not None:
            return f"{parent}.{piece.target}.{leaf}", piece
        return name, None

    def lazy_int4_params(self, names: Iterable[str]) -> set[str]:
        """Of the checkpoint names that will arrive as PrequantizedWeight, the parameters they fill
        that belong to a linear of their own (not shared, as a tied LM head is): those may stay on
        the meta device until loading shows they are needed as float."""
        counts = Counter(id(p) for p in self.params.values())
        lazy = set()
        for name in names:
            target, _ = self._route(name)
            module = self.modules.get(target.rpartition(".")[0])
            param = self.params.get(target)
            if isinstance(module, nn.Linear) and param is module.weight and counts[id(param)] == 1:
                lazy.add(target)
        return lazy

    def load(self, name: str, tensor: torch.Tensor | PrequantizedWeight) -> bool:
        """Copy one checkpoint tensor; False when the model has no place for it."""
        target, piece = self._route(name)
        if target not in self.params:
            return False
        if isinstance(tensor, PrequantizedWeight):
            return self._load_prequantized(name, target, piece, tensor)
        module_path, _, leaf = target.rpartition(".")
        if leaf == "weight" and isinstance(self.modules.get(module_path), nn.Linear):
            self._float_modules.add(module_path)
            if module_path in self._pending:
                self._fall_back(module_path, FLOAT_PIECE)
        self._copy(name, target, piece, tensor)
        return True

    def _copy(self, name: str, target: str, piece: FusedPiece | None, tensor: torch.Tensor) -> None:
        if self.transform is not None:
            tensor = self.transform(name, tensor)
        param = self._materialized(target)
        destination = param.data if piece is None else param.data[piece.start:piece.start + piece.size]
        if destination.shape != tensor.shape:
            raise MissingWeightsError(
                f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, but the model built from "
                f"config.json expects {tuple(destination.shape)}; the config and weights disagree")
        destination.copy_(tensor)
        self.missing.discard(name)

    def _materialized(self, target: str) -> nn.Parameter:
        """The parameter, allocated on the int4 device first if it was left on the meta device."""
        param = self.params[target]
        if not param.is_meta:
            return param
        if self.int4_device is None:
            raise RuntimeError(f"{target} is on the meta device and no device was given to load it")
        module_path, _, leaf = target.rpartition(".")
        fresh = nn.Parameter(torch.empty_like(param, device=self.int4_device), param.requires_grad)
        setattr(self.modules[module_path], leaf, fresh)
        self.params[target] = fresh
        return fresh

    # -- pre-quantized weights --

    def _load_prequantized(self, name: str, target: str, piece: FusedPiece | None,
                           weight: PrequantizedWeight) -> bool:
        module_path = target.rpartition(".")[0]
        module = self.modules.get(module_path)
        if self.int4_device is None or not isinstance(module, nn.Linear) or target != f"{module_path}.weight":
            self._copy(name, target, piece, weight.dequantize())  # embeddings, or int4 not asked for
            return True
        if module_path in self._float_modules:
            if module_path not in self._fell_back:
                self._fall_back(module_path, FLOAT_PIECE)
            self._copy(name, target, piece, weight.dequantize())
            return True
        reason = ""
        if weight.int4 is None:
            reason = f"the checkpoint stores them as {weight.source} with {weight.unfit_reason}"
        elif self.transform is not None:  # it may reorder or transpose rows: only floats go through it
            reason = "the model transforms its checkpoint tensors"
        elif weight.shape != (module.out_features if piece is None else piece.size, module.in_features):
            reason = "checkpoint and config disagree on their shape"  # _copy reports the mismatch
        pending = self._pending.setdefault(
            module_path, _PendingInt4(len(self.pieces_of.get(module_path.rpartition(".")[2], [])) or 1))
        pending.pieces[0 if piece is None else piece.start] = (name, weight)
        self.missing.discard(name)
        groups = {w.int4.group_size for _, w in pending.pieces.values() if w.int4 is not None}
        if not reason and len(groups) > 1:
            reason = f"its pieces have different group sizes ({', '.join(map(str, sorted(groups)))})"
        if reason:
            self._fall_back(module_path, reason)
        elif len(pending.pieces) == pending.expected:
            self._build(module_path, pending)
        return True

    def _build(self, module_path: str, pending: _PendingInt4) -> None:
        del self._pending[module_path]
        pieces = [pending.pieces[start] for start in sorted(pending.pieces)]
        q = concat_rows([weight.int4 for _, weight in pieces if weight.int4 is not None])
        layer = WeightOnlyLinear.from_int4(q).to(self.int4_device)
        self._ready[module_path] = layer
        self.int4.sources.update(weight.source for _, weight in pieces)
        self.int4.group_sizes.add(q.group_size)
        self.int4.zero_points |= q.offsets is not None
        self.int4.layers += 1

    def _fall_back(self, module_path: str, reason: str) -> None:
        """Load the module's pending int4 pieces as float (their exact dequantization)."""
        pending = self._pending.pop(module_path, None)
        self._float_modules.add(module_path)
        self._fell_back.add(module_path)
        self.int4.dequantized += 1
        self._fallbacks[reason] += 1
        self._fallback_example.setdefault(reason, module_path)
        for name, weight in (pending.pieces.values() if pending else ()):
            target, piece = self._route(name)
            self._copy(name, target, piece, weight.dequantize())

    def finish(self, checkpoint_desc: str) -> None:
        for module_path in list(self._pending):  # pieces never completed: the missing ones are reported
            self._fall_back(module_path, "some of its pieces are missing")
        if self.missing:
            names = sorted(self.missing)
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            raise MissingWeightsError(f"{checkpoint_desc} lacks {len(names)} tensor(s) the model "
                                      f"needs: {shown}")
        for module_path, layer in self._ready.items():
            old = self.modules[module_path]
            if old.bias is not None:
                layer.bias = old.bias.detach().float().clone()
            parent, _, child = module_path.rpartition(".")
            setattr(self.modules[parent], child, layer)
            self.int4.nbytes += layer.nbytes
        self._ready.clear()
        if self.int4.layers:
            logger.info("pre-quantized weights: %s", self.int4.describe())
        for reason, count in self._fallbacks.items():
            logger.info("pre-quantized weights: %d linear module(s) loaded as float instead of int4 "
                        "because %s (e.g. %s)", count, reason, self._fallback_example[reason])

