"""`kvik train`: the training loop, top to bottom.

set up (process group, task, model, optimizer, resume) -> for each step: the task's step (for most
tasks micro-batches, backward, clip, step), log, checkpoint, evaluate -> final checkpoint, export,
loss curve, summary. What a task supplies is described in kvik.train.task.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvik.train import checkpoint as ckpt
from kvik.train.config import TrainConfig
from kvik.train.distributed import DistInfo, barrier, init_distributed, shutdown, wrap_model
from kvik.train.flops import peak_flops
from kvik.train.monitor import SUMMARY_FILE, Monitor, plot_loss_curve, read_metrics
from kvik.train.optim import make_optimizer, make_scheduler
from kvik.train.task import Task


@dataclass(frozen=True, slots=True)
class TrainResult:
    output_dir: Path
    step: int  # optimizer steps completed, over all invocations
    finished: bool  # reached max_steps and exported the model
    first_loss: float | None  # of this invocation's first step
    last_loss: float | None
    val_loss: float | None
    tokens_per_second: float | None  # mean over this invocation's steps
    evaluation: dict[str, float] = field(default_factory=dict)  # the final evaluation's metrics


def make_task(config: TrainConfig) -> Task:
    """The task `config.task` names (each in a module of its own, imported only when used)."""
    if config.task in ("pretrain", "sft"):
        from kvik.train.lm import LanguageModelTask

        return LanguageModelTask(config)
    if config.task == "reward":
        from kvik.train.reward import RewardTask

        return RewardTask(config)
    if config.task == "dpo":
        from kvik.train.dpo import DPOTask

        return DPOTask(config)
    if config.task in ("ppo", "grpo"):
        from kvik.train.ppo import PPOTask

        return PPOTask(config)
    raise AssertionError(f"unvalidated task {config.task!r}")


@dataclass(slots=True)
class Session:
    """Everything a step needs, built once per invocation."""

    config: TrainConfig
    info: DistInfo
    task: Task
    model: torch.nn.Module  # wrapped for DDP / FSDP when distributed
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    autocast: Any  # bf16 autocast, or a null context in fp32
    bf16: bool
    num_params: int
    flops_per_token: float | None

    @property
    def unwrapped(self) -> torch.nn.Module:
        """The module without its DDP wrapper (FSDP2 wraps in place)."""
        return getattr(self.model, "module", self.model)


def _setup(config: TrainConfig, info: DistInfo) -> Session:
    torch.manual_seed(config.seed)  # the same fresh weights on every rank
    task = make_task(config)
    model = task.build_model().to(info.device)
    num_params = sum(p.numel() for p in model.parameters())
    flops_per_token = task.flops_per_token(model)
    model = wrap_model(model, info, config.distributed.strategy)
    optimizer = make_optimizer(model, config.optim)
    bf16 = config.precision == "bf16" or (
        config.precision == "auto" and info.device.type == "cuda" and torch.cuda.is_bf16_supported())
    autocast = torch.autocast(info.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    session = Session(config, info, task, model, optimizer,
                      make_scheduler(optimizer, config.optim, config.total_optimizer_steps(info.world_size)),
                      autocast, bf16, num_params, flops_per_token)
    task.attach(session)
    return session


def _evaluate(s: Session) -> dict[str, float]:
    s.model.eval()
    try:
        return s.task.evaluate(s)
    finally:
        s.model.train()


def _save(s: Session, step: int) -> None:
    ckpt.save_checkpoint(s.config.checkpoint_dir, step, s.model, s.optimizer, s.scheduler, s.info,
                         data_version=s.task.data_version, trainable_only=s.config.lora is not None,
                         keep_last=s.config.checkpoint.keep_last, task_state=s.task.state_dict())


class _InterruptFlag:
    """Ctrl-C in a single-process run: finish the current step, checkpoint, stop. (Under torchrun
    the agent owns signals and restarts; a worker that lingered on SIGTERM would only delay it.)"""

    def __init__(self, enabled: bool) -> None:
        self.raised = False
        self._previous = signal.signal(signal.SIGINT, self._handle) if enabled else None

    def _handle(self, signum: int, frame: Any) -> None:
        self.raised = True
        signal.signal(signal.SIGINT, self._previous)  # a second Ctrl-C interrupts at once

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def train(config: TrainConfig, *, stop_after_steps: int | None = None) -> TrainResult:
    """Run (or resume) the training `config` describes; on 1 process or under torchrun."""
    info = init_distributed(config.distributed.timeout_s)
    try:
        return _train(config, info, stop_after_steps)
    finally:
        shutdown(info)


def _train(config: TrainConfig, info: DistInfo, stop_after_steps: int | None) -> TrainResult:
    s = _setup(config, info)
    try:
        return _run(s, stop_after_steps)
    finally:
        s.task.close()


def _run(s: Session, stop_after_steps: int | None) -> TrainResult:
    config, info, task = s.config, s.info, s.task
    out_dir = Path(config.output_dir)
    step = 0
    checkpoints = ckpt.list_checkpoints(config.checkpoint_dir) if config.checkpoint.resume else []
    if checkpoints:
        resumed = ckpt.load_checkpoint(checkpoints[-1], s.model, s.optimizer, s.scheduler, info,
                                       trainable_only=config.lora is not None,
                                       data_version=task.data_version)
        step = resumed.step
        task.load_state_dict(resumed.task_state)
        if info.is_main:
            print(f"resumed from {checkpoints[-1]} at step {step}", flush=True)
    monitor = Monitor(out_dir, enabled=info.is_main, tensorboard=config.tensorboard, resumed_step=step)
    if info.is_main:
        (out_dir / "train_config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    peak = peak_flops(info.device, config.peak_flops) if info.is_main and s.flops_per_token else None
    end_step = config.max_steps if stop_after_steps is None else min(config.max_steps,
                                                                      step + stop_after_steps)
    saved_step = step if checkpoints else -1
    history: list[dict[str, Any]] = []
    s.model.train()
    if step == 0 and task.evaluate_at_start and task.has_evaluation():
        monitor.log({"step": 0, **_evaluate(s)})
    interrupt = _InterruptFlag(enabled=not info.is_distributed and
                               threading.current_thread() is threading.main_thread())
    while step < end_step and not interrupt.raised:
        stats = task.train_step(s, step)
        step += 1
        history.append(stats)
        if step % config.log_every == 0 or step == end_step:
            record = {"step": step, **stats}
            if "tokens_per_s" in stats:
                record["mfu"] = (s.flops_per_token * stats["tokens_per_s"] / (peak * info.world_size)
                                 if peak else None)
            monitor.log(record)
        if config.checkpoint.every_steps and step % config.checkpoint.every_steps == 0:
            _save(s, step)
            saved_step = step
        if task.has_evaluation() and config.eval_every and step % config.eval_every == 0:
            monitor.log({"step": step, **_evaluate(s)})
    interrupt.restore()
    if saved_step != step:
        _save(s, step)  # at exit: finished, stopped early or interrupted

    finished = step >= config.max_steps
    evaluation: dict[str, float] = {}
    if finished:
        if task.has_evaluation():
            evaluation = _evaluate(s)
            if not (config.eval_every and step % config.eval_every == 0):
                monitor.log({"step": step, **evaluation})
        _finish(s, monitor, {"steps": step, "val_loss": evaluation.get("val_loss"), **evaluation, "data_version": task.data_version,
                             "world_size": info.world_size, "strategy": config.distributed.strategy,
                             "precision": "bf16" if s.bf16 else "fp32", "num_params": s.num_params,
                             **task.summary()})
    monitor.close()
    speeds = [h["tokens_per_s"] for h in history if h.get("tokens_per_s")]
    return TrainResult(out_dir, step, finished, history[0]["loss"] if history else None,
                       history[-1]["loss"] if history else None, evaluation.get("val_loss"),
                       sum(speeds) / len(speeds) if speeds else None, evaluation)


def _finish(s: Session, monitor: Monitor, summary: dict[str, Any]) -> None:
    """Export the model, draw the loss curve, write the summary (last)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    config = s.config
    full_state = get_model_state_dict(s.model, options=StateDictOptions(full_state_dict=True,
                                                                         cpu_offload=True))
    if s.info.is_main:
        written = s.task.export(s, full_state)
        train_records = [r for r in read_metrics(monitor.path) if "loss" in r]
        plot_loss_curve(monitor.path, Path(config.output_dir) / "loss.png")
        if train_records:
            speeds = [r["tokens_per_s"] for r in train_records if r.get("tokens_per_s")]
            summary.update({
                "first_loss": train_records[0]["loss"], "last_loss": train_records[-1]["loss"],
                "mean_tokens_per_s": sum(speeds) / len(speeds) if speeds else None})
        summary["written"] = [str(p) for p in written]
        (Path(config.output_dir) / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    barrier(s.info)
