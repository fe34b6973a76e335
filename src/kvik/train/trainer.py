"""`kvik train`: the training loop, top to bottom.

set up (process group, data, model, optimizer, resume) -> for each step: micro-batches, backward,
clip, step, log, checkpoint, evaluate -> final checkpoint, export, loss curve, summary.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvik.train import checkpoint as ckpt
from kvik.train.batches import Batch, sample_numbers
from kvik.train.config import TrainConfig
from kvik.train.distributed import (DistInfo, all_reduce_sum, barrier, init_distributed, shutdown,
                                    wrap_model)
from kvik.train.export import export
from kvik.train.flops import matmul_params, peak_flops, training_flops_per_token
from kvik.train.model_setup import build_model, check_tokenizer_matches, load_tokenizer
from kvik.train.monitor import SUMMARY_FILE, Monitor, plot_loss_curve, read_metrics
from kvik.train.optim import make_optimizer, make_scheduler
from kvik.train.pretrain_data import PretrainSamples
from kvik.train.sft_data import SFTSamples, read_conversations
from kvik.train.shards import open_dataset


@dataclass(frozen=True, slots=True)
class TrainResult:
    output_dir: Path
    step: int  # optimizer steps completed, over all invocations
    finished: bool  # reached max_steps and exported the model
    first_loss: float | None  # of this invocation's first step
    last_loss: float | None
    val_loss: float | None
    tokens_per_second: float | None  # mean over this invocation's steps


@dataclass(slots=True)
class _Data:
    train: Any  # PretrainSamples | SFTSamples
    val: PretrainSamples | None
    tokenizer: Any
    tokenizer_dir: Path
    version: str | None


def _load_data(config: TrainConfig) -> _Data:
    if config.task == "sft":
        tokenizer_dir = Path(config.model.init_from)
        tokenizer = load_tokenizer(tokenizer_dir)
        samples = SFTSamples(tokenizer, read_conversations(config.data.sft_path), config.data.seq_len,
                             config.seed)
        return _Data(samples, None, tokenizer, tokenizer_dir, None)
    dataset = open_dataset(config.data.shards)  # refuses shards whose sha256 does not match
    if config.model.init_from:
        check_tokenizer_matches(Path(config.model.init_from), dataset.tokenizer_dir)
    val_stream = dataset.splits.get("val")
    val = None
    if val_stream is not None and len(val_stream) > config.data.seq_len:
        val = PretrainSamples(val_stream, config.data.seq_len, config.seed, shuffle=False)
    return _Data(PretrainSamples(dataset.splits["train"], config.data.seq_len, config.seed), val,
                 load_tokenizer(dataset.tokenizer_dir), dataset.tokenizer_dir, dataset.version)


def _loss_sum(model: torch.nn.Module, batch: Batch, autocast: Any) -> torch.Tensor:
    """Summed next-token cross-entropy over the batch's labelled positions (fp32 logits)."""
    with autocast:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch.labels.flatten(), ignore_index=-100,
                           reduction="sum")


def _gradient_sync(model: torch.nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Skip the gradient all-reduce on all but the last micro-batch of an accumulation."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
    elif hasattr(model, "no_sync") and not enabled:  # DDP
        return model.no_sync()
    return contextlib.nullcontext()


@dataclass(slots=True)
class _Session:
    """Everything a step needs, built once per invocation."""

    config: TrainConfig
    info: DistInfo
    data: _Data
    model: torch.nn.Module  # wrapped for DDP / FSDP when distributed
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    autocast: Any  # bf16 autocast, or a null context in fp32
    bf16: bool
    num_params: int
    flops_per_token: float


@dataclass(frozen=True, slots=True)
class _StepStats:
    loss: float  # mean over the global batch's label tokens
    grad_norm: float  # before clipping
    lr: float
    tokens: int  # processed by all ranks (padding excluded)
    seconds: float


def _setup(config: TrainConfig, info: DistInfo) -> _Session:
    torch.manual_seed(config.seed)  # the same fresh weights on every rank
    data = _load_data(config)
    model = build_model(config, data.tokenizer).to(info.device)
    num_params = sum(p.numel() for p in model.parameters())
    flops_per_token = training_flops_per_token(model.config, matmul_params(model), config.data.seq_len)
    model = wrap_model(model, info, config.distributed.strategy)
    optimizer = make_optimizer(model, config.optim)
    bf16 = config.precision == "bf16" or (
        config.precision == "auto" and info.device.type == "cuda" and torch.cuda.is_bf16_supported())
    autocast = torch.autocast(info.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    return _Session(config, info, data, model, optimizer,
                    make_scheduler(optimizer, config.optim, config.max_steps), autocast, bf16,
                    num_params, flops_per_token)


def _train_step(s: _Session, step: int) -> _StepStats:
    """One optimizer step (`step` counts from 0): accumulate micro-batches, clip, update."""
    started = time.perf_counter()
    config, info = s.config, s.info
    batches = [s.data.train.batch(sample_numbers(step, m, info.rank, info.world_size,
                                                 config.micro_batch_size, config.grad_accum_steps))
               for m in range(config.grad_accum_steps)]
    # Normalise by the label tokens of the whole global batch, so every token weighs the same
    # whatever its micro-batch or rank; the world-size factor undoes DDP's gradient averaging.
    counts = torch.tensor([sum(b.num_label_tokens for b in batches),
                           sum(b.input_ids.numel() if b.attention_mask is None
                               else int(b.attention_mask.sum()) for b in batches)], dtype=torch.float64)
    label_tokens, tokens = all_reduce_sum(counts.to(info.device), info).tolist()
    loss_sum = torch.zeros((), dtype=torch.float64, device=info.device)
    for m, batch in enumerate(batches):
        with _gradient_sync(s.model, m == len(batches) - 1):
            micro_loss = _loss_sum(s.model, batch.to(info.device), s.autocast)
            (micro_loss * info.world_size / label_tokens).backward()
        loss_sum += micro_loss.detach()
    max_norm = config.optim.grad_clip if config.optim.grad_clip is not None else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in s.model.parameters() if p.requires_grad],
                                               max_norm)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2 returns a DTensor
        grad_norm = grad_norm.full_tensor()
    lr = s.scheduler.get_last_lr()[0]
    s.optimizer.step()
    s.scheduler.step()
    s.optimizer.zero_grad(set_to_none=True)
    loss = float(all_reduce_sum(loss_sum, info)) / label_tokens
    return _StepStats(loss, float(grad_norm), lr, int(tokens), time.perf_counter() - started)


@torch.no_grad()
def _evaluate(s: _Session) -> float:
    """Mean loss over the same first validation windows every time, split across ranks."""
    s.model.eval()
    totals = torch.zeros(2, dtype=torch.float64)  # (loss sum, tokens)
    mbs, info = s.config.micro_batch_size, s.info
    for i in range(s.config.eval_batches):
        start = (i * info.world_size + info.rank) * mbs
        batch = s.data.val.batch(range(start, start + mbs)).to(info.device)
        totals[0] += float(_loss_sum(s.model, batch, s.autocast))
        totals[1] += batch.num_label_tokens
    s.model.train()
    totals = all_reduce_sum(totals.to(info.device), info).cpu()
    return float(totals[0] / totals[1])


def _save(s: _Session, step: int) -> None:
    ckpt.save_checkpoint(s.config.checkpoint_dir, step, s.model, s.optimizer, s.scheduler, s.info,
                         data_version=s.data.version, trainable_only=s.config.lora is not None,
                         keep_last=s.config.checkpoint.keep_last)


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
    out_dir = Path(config.output_dir)
    step = 0
    checkpoints = ckpt.list_checkpoints(config.checkpoint_dir) if config.checkpoint.resume else []
    if checkpoints:
        step = ckpt.load_checkpoint(checkpoints[-1], s.model, s.optimizer, s.scheduler, info,
                                    trainable_only=config.lora is not None,
                                    data_version=s.data.version).step
        if info.is_main:
            print(f"resumed from {checkpoints[-1]} at step {step}", flush=True)
    monitor = Monitor(out_dir, enabled=info.is_main, tensorboard=config.tensorboard, resumed_step=step)
    if info.is_main:
        (out_dir / "train_config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    peak = peak_flops(info.device, config.peak_flops) if info.is_main else None
    end_step = config.max_steps if stop_after_steps is None else min(config.max_steps,
                                                                      step + stop_after_steps)
    saved_step = step if checkpoints else -1
    history: list[_StepStats] = []
    s.model.train()
    interrupt = _InterruptFlag(enabled=not info.is_distributed and
                               threading.current_thread() is threading.main_thread())
    while step < end_step and not interrupt.raised:
        stats = _train_step(s, step)
        step += 1
        history.append(stats)
        if step % config.log_every == 0 or step == end_step:
            speed = stats.tokens / stats.seconds
            monitor.log({"step": step, "loss": stats.loss, "lr": stats.lr, "grad_norm": stats.grad_norm,
                         "tokens": stats.tokens, "tokens_per_s": speed,
                         "mfu": s.flops_per_token * speed / (peak * info.world_size) if peak else None,
                         "step_time_s": stats.seconds})
        if config.checkpoint.every_steps and step % config.checkpoint.every_steps == 0:
            _save(s, step)
            saved_step = step
        if s.data.val is not None and config.eval_every and step % config.eval_every == 0:
            monitor.log({"step": step, "val_loss": _evaluate(s)})
    interrupt.restore()
    if saved_step != step:
        _save(s, step)  # at exit: finished, stopped early or interrupted

    finished = step >= config.max_steps
    val_loss = None
    if finished:
        if s.data.val is not None:
            val_loss = _evaluate(s)
            if not (config.eval_every and step % config.eval_every == 0):
                monitor.log({"step": step, "val_loss": val_loss})
        _finish(s, monitor, {"steps": step, "val_loss": val_loss, "data_version": s.data.version,
                             "world_size": info.world_size, "strategy": config.distributed.strategy,
                             "precision": "bf16" if s.bf16 else "fp32", "num_params": s.num_params})
    monitor.close()
    return TrainResult(out_dir, step, finished, history[0].loss if history else None,
                       history[-1].loss if history else None, val_loss,
                       sum(h.tokens / h.seconds for h in history) / len(history) if history else None)


def _finish(s: _Session, monitor: Monitor, summary: dict[str, Any]) -> None:
    """Export the model, draw the loss curve, write the summary (last)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    config = s.config
    full_state = get_model_state_dict(s.model, options=StateDictOptions(full_state_dict=True,
                                                                         cpu_offload=True))
    if s.info.is_main:
        written = export(config, full_state, s.data.tokenizer, s.data.tokenizer_dir)
        train_records = [r for r in read_metrics(monitor.path) if "loss" in r]
        plot_loss_curve(monitor.path, Path(config.output_dir) / "loss.png")
        if train_records:
            summary.update({
                "first_loss": train_records[0]["loss"], "last_loss": train_records[-1]["loss"],
                "mean_tokens_per_s": sum(r["tokens_per_s"] for r in train_records) / len(train_records)})
        summary["written"] = [str(p) for p in written]
        (Path(config.output_dir) / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    barrier(s.info)
