"""LoRA-aware linear layers for a mixed batch: every token adds its own adapter's low-rank update.

`enable_lora` swaps each target linear of a loaded model (q/k/v, o, gate/up, down: kvik fuses q/k/v
and gate/up, so one `LoRALinear` serves several PEFT modules, one "piece" of its output each) for a
`LoRALinear` that wraps it, whatever it is (nn.Linear, oneDNN-packed, int8/int4 weight-only). The
wrapper adopts the base layer's parameters under their own names, so state dicts and weight sync
see the model unchanged.

Adapter weights sit in stacks with one row per slot (`max_loras` slots, rank padded with zeros to
`max_rank`): A (slots, pieces * max_rank, in) and B (slots, out, pieces * max_rank), B block-structured so
piece p's output rows read only its own rank columns. One step's token -> slot mapping is a list of
contiguous segments, set once per step on the `LoRAContext` all wrappers share (the runner sorts the
batch by adapter, so each adapter's tokens are one or two runs); each wrapper then adds, per
segment, x[seg] @ A[slot]^T @ B[slot]^T. Grouping by slot keeps the two GEMMs per segment on plain
contiguous slices; gathering a weight copy per token for a bmm moves pieces x rank x (in + out)
floats per token and layer. Measured on one CPU thread, 8 adapters of rank 8: 8 decode rows 0.39 vs
0.45 ms (256 -> 512, q/k/v) and 0.56 vs 1.47 ms (768 -> 2304); 32 rows 0.39 vs 1.6 ms and 1.0 vs
7.8 ms, grouped against gather + bmm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvik.core.errors import ConfigError, LoRAAdapterError
from kvik.model.lora.adapter import LoRAAdapterWeights

# The linears an adapter may target, by kvik's (fused) attribute name.
TARGET_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


# Up to this many adapter rows in a step, the LoRA GEMMs (a few rows by rank columns) run on one
# thread: splitting them across threads costs more in synchronisation than the arithmetic, and on a
# loaded machine (threads waiting for a core) each parallel region of a tiny GEMM measured 2-50 ms
# against 0.05-0.4 ms on one thread.
SINGLE_THREAD_ROWS = 256


class LoRAContext:
    """The current step's adapter segments: (first row, end row, slot) over the flat token batch.
    Empty when no token of the step uses an adapter (then the wrappers add nothing)."""

    __slots__ = ("segments", "single_thread")

    def __init__(self) -> None:
        self.segments: list[tuple[int, int, int]] = []
        self.single_thread = False

    def set(self, segments: list[tuple[int, int, int]]) -> None:
        self.segments = segments
        self.single_thread = sum(end - start for start, end, _ in segments) <= SINGLE_THREAD_ROWS

    @property
    def active(self) -> bool:
        return bool(self.segments)


@dataclass(frozen=True, slots=True)
class _Piece:
    hf_name: str  # the PEFT/HF module name of this piece ("q_proj")
    start: int  # first output row in the fused linear
    size: int


class LoRALinear(nn.Module):
    """base(x) plus, for each segment of tokens, that slot's (x A^T) B^T (scale folded into B)."""

    def __init__(self, base: nn.Module, pieces: list[_Piece], context: LoRAContext, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        for name, param in base.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buffer in base.named_buffers(recurse=False):
            self.register_buffer(name, buffer)
        object.__setattr__(self, "base", base)  # outside the module tree: names stay the base's
        self.in_features, self.out_features = base.in_features, base.out_features
        self.pieces = pieces
        self.max_rank = max_rank
        self.lora_context = context
        width = len(pieces) * max_rank
        # Plain attributes, not buffers: adapters are not part of the model's state dict.
        self.lora_a = torch.zeros(max_loras, width, self.in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, self.out_features, width, dtype=dtype, device=device)
        self.slot_used = [False] * max_loras  # the slot's adapter targets at least one piece here

    def kernel_weight(self) -> object:
        """The base layer's compiled weight (the decode stack runs it for steps without adapters)."""
        getter = getattr(self.base, "kernel_weight", None)
        return getter() if getter is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        context = self.lora_context
        if not context.segments:
            return out
        threads = torch.get_num_threads() if context.single_thread else 1
        if threads > 1:
            torch.set_num_threads(1)
        try:
            for start, end, slot in context.segments:
                if self.slot_used[slot]:
                    rows = x[start:end]
                    out[start:end].addmm_(rows @ self.lora_a[slot].T, self.lora_b[slot].T)
        finally:
            if threads > 1:
                torch.set_num_threads(threads)
        return out

    def set_slot(self, slot: int, pieces: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write one adapter into `slot`: piece index -> (A (r, in), B (size, r), scaled); pieces it
        does not target (and ranks below max_rank) stay zero."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        rank = self.max_rank
        for index, (a, b) in pieces.items():
            piece, r = self.pieces[index], a.shape[0]
            self.lora_a[slot, index * rank:index * rank + r].copy_(a)
            self.lora_b[slot, piece.start:piece.start + piece.size, index * rank:index * rank + r].copy_(b)
        self.slot_used[slot] = bool(pieces)

    def clear_slot(self, slot: int) -> None:
        self.slot_used[slot] = False


class LoRAModel:
    """The LoRA view of one model: which HF module lives where, and the slots' contents."""

    def __init__(self, targets: dict[str, tuple[LoRALinear, int]], context: LoRAContext, max_loras: int,
                 max_rank: int) -> None:
        self.targets = targets  # HF module path -> (wrapper, piece index)
        self.context = context
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.wrappers = list(dict.fromkeys(wrapper for wrapper, _ in targets.values()))

    @property
    def nbytes(self) -> int:
        """Memory the slot stacks take (all slots, whether filled or not)."""
        return sum(w.lora_a.numel() * w.lora_a.element_size() + w.lora_b.numel() * w.lora_b.element_size()
                   for w in self.wrappers)

    def check(self, adapter: LoRAAdapterWeights) -> None:
        """Refuse an adapter this model cannot serve: rank above max_rank, a module the model does
        not have (another architecture, or a target kvik does not adapt), shapes of another model."""
        if adapter.rank > self.max_rank:
            raise LoRAAdapterError(f"lora_path: the adapter has rank {adapter.rank}, above --max-lora-rank "
                                   f"{self.max_rank}; restart with a larger --max-lora-rank", param="lora_path")
        for module, (a, b) in adapter.weights.items():
            target = self.targets.get(module)
            if target is None:
                served = sorted({name.rsplit(".", 1)[-1] for name in self.targets})
                raise LoRAAdapterError(
                    f"lora_path: the adapter targets {module}, which this base model has no adaptable layer "
                    f"for (adaptable: {', '.join(served)}); was it trained for another base model?",
                    param="lora_path")
            wrapper, index = target
            piece = wrapper.pieces[index]
            if a.shape[1] != wrapper.in_features or b.shape[0] != piece.size:
                raise LoRAAdapterError(
                    f"lora_path: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, but the base model's "
                    f"layer is {wrapper.in_features} -> {piece.size}; the adapter belongs to another base model",
                    param="lora_path")

    def load(self, slot: int, adapter: LoRAAdapterWeights) -> None:
        """Copy a checked adapter into `slot` of every wrapper."""
        per_wrapper: dict[LoRALinear, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {w: {} for w in self.wrappers}
        for module, (a, b) in adapter.weights.items():
            wrapper, index = self.targets[module]
            per_wrapper[wrapper][index] = (a, b)
        for wrapper, pieces in per_wrapper.items():
            wrapper.set_slot(slot, pieces)

    def clear(self, slot: int) -> None:
        for wrapper in self.wrappers:
            wrapper.clear_slot(slot)


def enable_lora(model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                device: torch.device) -> LoRAModel:
    """Swap `model`'s target linears for LoRALinear wrappers with `max_loras` slots of rank
    `max_rank`; run after optimize_for_inference (the wrappers keep whatever layer it left) and
    before the KV cache is bound (the decode stack learns the context then)."""
    if max_loras < 1 or max_rank < 1:
        raise ConfigError(f"max_loras and max_lora_rank must be at least 1 (got {max_loras}, {max_rank})")
    loader_of = getattr(model, "weight_loader", None)
    fused = loader_of().pieces_of if loader_of is not None else {}
    if not any(name in fused for name in TARGET_LINEARS):
        raise ConfigError(f"LoRA serving supports the Llama family (Llama, Mistral, Qwen2, Qwen3); "
                          f"{type(model).__name__} has no adaptable q/k/v and MLP projections")
    context = LoRAContext()
    targets: dict[str, tuple[LoRALinear, int]] = {}
    for parent_name, parent in list(model.named_modules()):
        for attr, child in list(parent.named_children()):
            if attr not in TARGET_LINEARS or not hasattr(child, "in_features"):
                continue
            if attr in fused:
                pieces = [_Piece(p.source, p.start, p.size) for p in fused[attr]]
            else:
                pieces = [_Piece(attr, 0, child.out_features)]
            wrapper = LoRALinear(child, pieces, context, max_loras, max_rank, dtype, device)
            setattr(parent, attr, wrapper)
            for index, piece in enumerate(pieces):
                targets[f"{parent_name}.{piece.hf_name}"] = (wrapper, index)
    return LoRAModel(targets, context, max_loras, max_rank)
