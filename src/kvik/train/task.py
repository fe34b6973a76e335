"""What a training task (`task:` in train.yaml) plugs into the shared loop of kvik.train.trainer.

The trainer owns the process group, the model's DDP/FSDP wrapping, the optimizer and schedule,
checkpoints and exact resume, the metrics log and the loss curve. A task owns its data, builds its
trainable module, computes one optimizer step's loss, evaluates, and writes the result.

Most tasks are supervised: a global batch of samples per step, accumulated over micro-batches.
They implement `SupervisedTask` and share `supervised_step`. PPO and GRPO generate their own data
each step and implement `train_step` themselves.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvik.train.batches import sample_numbers
from kvik.train.distributed import all_reduce_sum

if TYPE_CHECKING:
    from kvik.train.trainer import Session


class Task:
    """Base of every task; the defaults suit a task without extra state."""

    name = "task"
    # Evaluate once before the first step too (tasks whose starting point is a baseline to beat).
    evaluate_at_start = False

    data_version: str | None = None
    tokenizer: Any = None
    tokenizer_dir: Path | None = None

    def build_model(self) -> torch.nn.Module:
        """The trainable module on the CPU in fp32 (the trainer moves and wraps it); use the global
        torch RNG for fresh weights so that every rank builds the same model."""
        raise NotImplementedError

    def attach(self, session: Session) -> None:
        """Called once the session exists (frozen models, engines...)."""

    def train_step(self, session: Session, step: int) -> dict[str, Any]:
        """One step (counting from 0); returns the metrics to log (with "loss")."""
        raise NotImplementedError

    def has_evaluation(self) -> bool:
        return False

    def evaluate(self, session: Session) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Task state a checkpoint must hold besides the model and optimizer."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def flops_per_token(self, model: torch.nn.Module) -> float | None:
        return None

    def export(self, session: Session, full_state: dict[str, torch.Tensor]) -> list[Path]:
        """Rank 0: write the result into the output directory; returns what was written."""
        raise NotImplementedError

    def summary(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        """Release what `attach` started."""


def gradient_sync(model: torch.nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Skip the gradient all-reduce on all but the last micro-batch of an accumulation."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
    elif hasattr(model, "no_sync") and not enabled:  # DDP
        return model.no_sync()
    return contextlib.nullcontext()


def clip_and_step(session: Session) -> tuple[float, float]:
    """Clip the global gradient norm, step the optimizer and schedule; returns (grad_norm, lr)."""
    config = session.config
    max_norm = config.optim.grad_clip if config.optim.grad_clip is not None else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(
        [p for p in session.model.parameters() if p.requires_grad], max_norm)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2 returns a DTensor
        grad_norm = grad_norm.full_tensor()
    lr = session.scheduler.get_last_lr()[0]
    session.optimizer.step()
    session.scheduler.step()
    session.optimizer.zero_grad(set_to_none=True)
    return float(grad_norm), lr


@dataclass(frozen=True, slots=True)
class MicroLoss:
    """One micro-batch's summed loss, and summed metrics normalised like it."""

    loss_sum: torch.Tensor  # scalar, with grad
    metric_sums: dict[str, torch.Tensor]


class SupervisedTask(Task):
    """A task whose step is a fixed global batch of samples chosen by the step number alone."""

    train_samples: Any  # .batch(range) -> batch with .to(device)

    def count(self, batch: Any) -> int:
        """Units the loss is averaged over (label tokens, pairs)."""
        raise NotImplementedError

    def tokens(self, batch: Any) -> int:
        """Real (non-padding) tokens in the batch, for throughput."""
        mask = batch.attention_mask
        return batch.input_ids.numel() if mask is None else int(mask.sum())

    def micro_loss(self, model: torch.nn.Module, batch: Any, autocast: Any) -> MicroLoss:
        raise NotImplementedError

    def train_step(self, session: Session, step: int) -> dict[str, Any]:
        return supervised_step(session, self, step)


def supervised_step(s: Session, task: SupervisedTask, step: int) -> dict[str, Any]:
    """Accumulate micro-batches, clip, update. Normalises by the count of the whole global batch,
    so every unit weighs the same whatever its micro-batch or rank; the world-size factor undoes
    DDP's gradient averaging."""
    started = time.perf_counter()
    config, info = s.config, s.info
    batches = [task.train_samples.batch(sample_numbers(step, m, info.rank, info.world_size,
                                                       config.micro_batch_size,
                                                       config.grad_accum_steps))
               for m in range(config.grad_accum_steps)]
    counts = torch.tensor([sum(task.count(b) for b in batches), sum(task.tokens(b) for b in batches)],
                          dtype=torch.float64)
    units, tokens = all_reduce_sum(counts.to(info.device), info).tolist()
    loss_sum = torch.zeros((), dtype=torch.float64, device=info.device)
    metric_sums: dict[str, torch.Tensor] = {}
    for m, batch in enumerate(batches):
        with gradient_sync(s.model, m == len(batches) - 1):
            micro = task.micro_loss(s.model, batch.to(info.device), s.autocast)
            (micro.loss_sum * info.world_size / units).backward()
        loss_sum += micro.loss_sum.detach()
        for key, value in micro.metric_sums.items():
            metric_sums[key] = metric_sums.get(key, 0) + value.detach().double()
    grad_norm, lr = clip_and_step(s)
    loss = float(all_reduce_sum(loss_sum, info)) / units
    seconds = time.perf_counter() - started
    record: dict[str, Any] = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": int(tokens),
                              "tokens_per_s": tokens / seconds}
    for key in sorted(metric_sums):
        record[key] = float(all_reduce_sum(metric_sums[key].to(info.device), info)) / units
    record["step_time_s"] = seconds
    return record
