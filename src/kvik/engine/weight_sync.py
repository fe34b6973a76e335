"""Replace a running engine's weights in place, from tensors under their HF checkpoint names.

RL fine-tuning samples from the engine, updates the weights in the trainer, and must sample from the
new weights next; writing a checkpoint and reloading the engine each time would cost seconds (see
bench/weight_sync.py). Here the trainer hands over its state dict and every tensor is copied into
the engine's own storage:

- names go through the model's own loader (the one that reads safetensors), so q/k/v and gate/up
  land in their rows of the fused `qkv_proj` / `gate_up_proj`, GPT-2's Conv1D weights are
  transposed, and a tied LM head copy is skipped;
- linears packed for oneDNN (CPU float32; the dense weight no longer exists) are rewritten *in their
  existing packed buffer*: the compiled decode stack holds raw addresses of those buffers, so they
  must not move. Where the packed layout is the one the small-batch GEMV reads and was checked at
  load ([blocks][in_stride][block], see transforms.onednn_linear), each tensor is written straight
  into it with one strided copy, pieces of fused weights included. Otherwise the full dense weight
  is assembled from its pieces, packed again by oneDNN and copied over the old buffer, so such a
  linear needs all of its pieces in one update (all of q, k and v);
- an LM head tied to the embedding and packed separately is repacked from the new embedding;
- the prefix cache is emptied: its blocks hold keys and values computed with the old weights;
- the LM head's int8 copy for greedy steps (transforms.screened_head) is dropped for good.

Updates happen between steps: the engine must have no unfinished requests. An engine whose linears
are quantized (WeightOnlyLinear: --quantization, or --dtype bfloat16 on the CPU) refuses updates.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from kvik.core.errors import InvalidRequestError, MissingWeightsError
from kvik.engine.kv_manager import KVCacheManager
from kvik.model.lora import LoRALinear
from kvik.model.quant.linear import WeightOnlyLinear
from kvik.model.transforms.onednn_linear import PACKING_BATCH_HINT, OneDNNLinear, _packed_floats


@dataclass(frozen=True, slots=True)
class WeightUpdate:
    """What one `update_weights` call did."""

    tensors: int  # checkpoint tensors copied
    repacked: int  # oneDNN-packed linears rewritten
    prefix_blocks_dropped: int  # cached KV blocks invalidated
    seconds: float


@dataclass(slots=True)
class _Staged:
    """A packed linear's dense weight being assembled, and which of its rows have arrived."""

    module: OneDNNLinear
    weight: torch.Tensor  # (out_features, in_features) float32
    rows: torch.Tensor  # (out_features,) bool


def _repack_in_place(module: OneDNNLinear, weight: torch.Tensor) -> None:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACKING_BATCH_HINT)
    source, target = _packed_floats(packed), _packed_floats(module.packed)
    if source.numel() != target.numel():  # same shape and hint: oneDNN picks the same layout
        raise RuntimeError(f"oneDNN packed a {tuple(weight.shape)} weight into {source.numel()} "
                           f"floats, the engine's buffer holds {target.numel()}")
    target.copy_(source)
    del packed


def _packed_view(module: OneDNNLinear) -> tuple[torch.Tensor, int] | None:
    """(packed buffer as (blocks, in_stride, block) floats, block) where the layout is known."""
    spec = module.gemv_spec()
    if spec is None:
        return None
    _, out_features, in_stride, block, _ = spec
    blocks = -(-out_features // block)
    floats = _packed_floats(module.packed)
    if floats.numel() != blocks * in_stride * block:
        return None
    return floats.view(blocks, in_stride, block), block


def _write_packed_rows(view: torch.Tensor, block: int, start: int, rows: torch.Tensor) -> None:
    """Write dense rows (n, in) as rows [start, start + n) of a packed (blocks, in_stride, block)
    weight: row r lives at [r // block, :in, r % block]. Whole blocks go in one strided copy."""
    count, in_features = rows.shape
    row = start
    end = start + count
    while row < end:
        first_block, lane = divmod(row, block)
        if lane == 0 and end - row >= block:
            blocks = (end - row) // block
            chunk = rows[row - start:row - start + blocks * block]
            view[first_block:first_block + blocks, :in_features, :].copy_(
                chunk.view(blocks, block, in_features).transpose(1, 2))
            row += blocks * block
            continue
        take = min(block - lane, end - row)
        view[first_block, :in_features, lane:lane + take].copy_(rows[row - start:row - start + take].t())
        row += take


def _tied_head(model: nn.Module) -> tuple[OneDNNLinear, torch.Tensor] | None:
    """The LM head packed from a tied embedding, and that embedding's weight."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, OneDNNLinear):
        return None
    tied = getattr(model.config, "tie_word_embeddings", False) or not hasattr(model, "model")
    if not tied:
        return None
    inner = getattr(model, "model", None) or getattr(model, "transformer", None)
    embedding = getattr(inner, "embed_tokens", None) or getattr(inner, "wte", None)
    return (head, embedding.weight) if isinstance(embedding, nn.Embedding) else None


def _module_param(name: str) -> tuple[str, str, str]:
    """'a.b.q_proj.weight' -> ('a.b', 'q_proj', 'weight')."""
    module_path, _, leaf = name.rpartition(".")
    parent, _, attr = module_path.rpartition(".")
    return parent, attr, leaf


def _linears(model: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    """Every module by name, with a LoRA wrapper's base layer under the wrapper's name (the wrapper
    shares the base's parameters; its packed or quantized storage is the base's own)."""
    for name, module in model.named_modules():
        yield name, module.base if isinstance(module, LoRALinear) else module


@torch.no_grad()
def load_weights_in_place(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]
                          ) -> tuple[int, int]:
    """Copy HF-named tensors into `model` (see the module docstring); returns (tensors, repacked)."""
    loader = model.weight_loader()
    packed = {name: m for name, m in _linears(model) if isinstance(m, OneDNNLinear)}
    staged: dict[str, _Staged] = {}
    written_direct: set[str] = set()
    copied = 0
    embedding_changed = False
    for raw_name, tensor in named_tensors:
        if model.skip_checkpoint_tensor(raw_name):
            continue
        name = model.checkpoint_name(raw_name)
        parent, attr, leaf = _module_param(name)
        piece = loader.fused.get(attr)
        target = f"{parent}.{piece.target if piece else attr}".lstrip(".")
        if leaf == "weight" and target in packed:
            if loader.transform is not None:
                tensor = loader.transform(name, tensor)
            module = packed[target]
            start, size = (piece.start, piece.size) if piece else (0, module.out_features)
            if tuple(tensor.shape) != (size, module.in_features):
                raise InvalidRequestError(f"update_weights: {raw_name} has shape "
                                          f"{tuple(tensor.shape)}, the model expects "
                                          f"{(size, module.in_features)}")
            direct = _packed_view(module)
            if direct is not None:
                _write_packed_rows(direct[0], direct[1], start, tensor)
                written_direct.add(target)
                copied += 1
                continue
            entry = staged.get(target)
            if entry is None:
                entry = staged[target] = _Staged(
                    module, torch.empty(module.out_features, module.in_features),
                    torch.zeros(module.out_features, dtype=torch.bool))
            entry.weight[start:start + size].copy_(tensor)
            entry.rows[start:start + size] = True
            copied += 1
            continue
        try:
            found = loader.load(name, tensor)
        except MissingWeightsError as exc:  # a shape mismatch, worded for checkpoints
            raise InvalidRequestError(f"update_weights: {exc.message}") from exc
        if not found:
            raise InvalidRequestError(f"update_weights: the model has no parameter for {raw_name}")
        embedding_changed |= name.endswith(("embed_tokens.weight", "wte.weight"))
        copied += 1
    incomplete = sorted(name for name, entry in staged.items() if not bool(entry.rows.all()))
    if incomplete:
        raise InvalidRequestError(
            "update_weights: these linears are packed for oneDNN and need every piece of their "
            f"weight in one update (e.g. q, k and v together): {', '.join(incomplete[:4])}")
    for entry in staged.values():
        _repack_in_place(entry.module, entry.weight)
    repacked = len(staged) + len(written_direct)
    tied = _tied_head(model)
    if tied is not None and embedding_changed:
        head, embedding = tied
        direct = _packed_view(head)
        if direct is not None:
            _write_packed_rows(direct[0], direct[1], 0, embedding.detach().float())
        else:
            _repack_in_place(head, embedding.detach().float())
        repacked += 1
    return copied, repacked


def invalidate_prefix_cache(kv: KVCacheManager) -> int:
    """Forget every cached block (all are unreferenced between steps); returns how many."""
    dropped = kv.pool.reset_prefix_cache()
    if kv.pool.cached:
        raise RuntimeError("prefix-cache blocks still referenced after a weight update")
    return dropped


def update_engine_weights(engine: object, weights: Mapping[str, torch.Tensor]
                          | Iterable[tuple[str, torch.Tensor]]) -> WeightUpdate:
    """`LLM.update_weights`: see the module docstring. `engine` is an idle `EngineCore`."""
    if engine.has_unfinished_requests():
        raise InvalidRequestError("update_weights: the engine still has unfinished requests; "
                                  "update between generate() calls")
    quantized = next((m for _, m in _linears(engine.model) if isinstance(m, WeightOnlyLinear)), None)
    if quantized is not None:
        # Re-quantizing in place is possible but not built: the compiled kernels hold addresses of
        # the packed int8/int4/bfloat16 buffers, and a trainer wants its float weights served as is.
        raise InvalidRequestError(
            f"update_weights: this engine stores its linear weights as {quantized.kind} (--quantization "
            "or --dtype bfloat16 on the CPU); weight sync needs float weights: start the engine "
            "without --quantization, with --dtype float32")
    started = time.perf_counter()
    items = weights.items() if isinstance(weights, Mapping) else weights
    device, dtype = engine.device, engine.dtype
    converted = ((name, tensor.detach().to(device=device, dtype=dtype)) for name, tensor in items)
    # First, so that no greedy step reads a copy of weights that are (even partly) rewritten.
    engine.runner.drop_greedy_head_copy()
    copied, repacked = load_weights_in_place(engine.model, converted)
    dropped = invalidate_prefix_cache(engine.kv)
    return WeightUpdate(copied, repacked, dropped, time.perf_counter() - started)
