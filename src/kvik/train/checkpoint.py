"""Training checkpoints: everything needed to continue a run exactly, written atomically.

A checkpoint is a directory `step-NNNNNNNN/` holding model.pt and optimizer.pt (full, unsharded state
dicts, so a run may resume with another strategy), trainer.pt (step, scheduler, data version) and
rng-rank<R>.pt per process; trainer.pt also holds the task's own state (e.g. PPO's KL coefficient). It is written under `.tmp-step-NNNNNNNN/` and renamed into place only
when complete: a crash mid-save leaves the previous checkpoints untouched, and any directory named
`step-*` is whole. The data position is the step itself (see `kvik.train.batches`).
"""

from __future__ import annotations

import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from kvik.core.errors import ConfigError
from kvik.train.distributed import DistInfo, barrier

_STEP_DIR = re.compile(r"^step-(\d{8})$")


@dataclass(frozen=True, slots=True)
class ResumeState:
    step: int  # optimizer steps completed (PPO/GRPO: iterations)
    data_version: str | None
    task_state: dict[str, Any]  # what the task's state_dict() returned when saving


def _state_options(trainable_only: bool) -> StateDictOptions:
    # Frozen weights (a LoRA base model) are reloaded from the base, so they are not saved.
    return StateDictOptions(full_state_dict=True, cpu_offload=True,
                            ignore_frozen_params=trainable_only, strict=not trainable_only)


def _rng_state() -> dict[str, Any]:
    numpy_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))


def save_checkpoint(root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, info: DistInfo, *, data_version: str | None,
                    trainable_only: bool, keep_last: int,
                    task_state: dict[str, Any] | None = None) -> Path:
    """Write the checkpoint of `step` (a collective: every rank calls it) and keep the newest
    `keep_last`. Returns the checkpoint directory."""
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-{final.name}"
    # Under FSDP gathering the full state is itself a collective, so every rank takes part.
    model_state, optim_state = get_state_dict(model, optimizer, options=_state_options(trainable_only))
    if info.is_main:
        for debris in root.glob(".tmp-step-*"):  # left by a crash mid-save
            shutil.rmtree(debris, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(info)
    _save(_rng_state(), tmp / f"rng-rank{info.rank}.pt")
    if info.is_main:
        _save(model_state, tmp / "model.pt")
        _save(optim_state, tmp / "optimizer.pt")
        _save({"step": step, "scheduler": scheduler.state_dict(), "data_version": data_version,
               "world_size": info.world_size, "task_state": task_state or {}}, tmp / "trainer.pt")
    barrier(info)
    if info.is_main:
        _fsync_dir(tmp)
        if final.exists():  # the same step saved by an earlier attempt: identical content
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, final)  # atomic on POSIX: the checkpoint appears whole or not at all
            _fsync_dir(root)
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old)
    barrier(info)
    return final


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, info: DistInfo, *, trainable_only: bool,
                    data_version: str | None) -> ResumeState:
    """Restore a checkpoint written by `save_checkpoint` into freshly built objects."""
    trainer = torch.load(path / "trainer.pt", weights_only=False)
    if data_version and trainer["data_version"] and trainer["data_version"] != data_version:
        raise ConfigError(f"{path} was trained on dataset version {trainer['data_version']}, but "
                          f"the shards are version {data_version}; use another output_dir or set "
                          "checkpoint.resume: false")
    model_state = torch.load(path / "model.pt", weights_only=True)
    optim_state = torch.load(path / "optimizer.pt", weights_only=False)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=_state_options(trainable_only))
    scheduler.load_state_dict(trainer["scheduler"])
    rng_file = path / f"rng-rank{info.rank}.pt"
    if not rng_file.exists():  # resumed with more processes than saved it: best effort
        rng_file = path / "rng-rank0.pt"
    _set_rng_state(torch.load(rng_file, weights_only=False))
    return ResumeState(int(trainer["step"]), trainer["data_version"], trainer.get("task_state") or {})
