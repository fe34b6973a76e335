"""One process or many: process-group set-up under torchrun, and DDP or FSDP2 wrapping.

The same command runs alone (`kvik train ...`) or under `torchrun --nproc-per-node N`; without
torchrun's environment there is no process group and every collective is a no-op.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _attempt_store(timeout: timedelta) -> dist.Store | None:
    """The rendezvous store for this restart attempt, or None to let env:// build one.

    torchrun (2.5+) shares its agent's TCP store with the workers and keeps that one store for the
    whole job, so after a restart the keys the failed attempt's process group wrote are still
    there, and restarted workers can read a dead peer's address from them (pytorch#135712). Keys
    under a prefix per restart keep each attempt to itself. The restart count agrees across nodes
    as long as the same agents restart together; where an agent itself is replaced (a new node
    joins an elastic job) its count starts again at 0, and torchrun should run with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 instead, which gives workers a store of their own.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    shared = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"kvik-train/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
                            shared)


def init_distributed(timeout_s: float) -> DistInfo:
    """Join the process group torchrun describes in the environment (gloo on CPU, NCCL on GPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        # A finite timeout: a collective waiting on a dead peer fails instead of hanging, so
        # torchrun sees the failure and restarts the group.
        timeout = timedelta(seconds=timeout_s)
        backend = "nccl" if device.type == "cuda" else "gloo"
        store = _attempt_store(timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timeout)
    return DistInfo(rank, world_size, local_rank, device)


def shutdown(info: DistInfo) -> None:
    if info.is_distributed and dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.is_distributed:
        dist.barrier()


def all_reduce_sum(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.is_distributed:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def broadcast_object(value: object, info: DistInfo) -> object:
    """Rank 0's `value` on every rank."""
    if not info.is_distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks HF marks as not to be split (e.g. LlamaDecoderLayer): FSDP units."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def wrap_model(model: torch.nn.Module, info: DistInfo, strategy: str) -> torch.nn.Module:
    """DDP: a full replica per process, gradients averaged. FSDP2: parameters, gradients and
    optimizer state sharded per decoder layer, for models that do not fit one device."""
    if not info.is_distributed:
        return model
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in _decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [info.local_rank] if info.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)
