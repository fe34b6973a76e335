"""AdamW with weight decay on matrices only, and a cosine learning-rate schedule with warm-up."""

from __future__ import annotations

import math

import torch

from kvik.train.config import OptimConfig


def make_optimizer(model: torch.nn.Module, config: OptimConfig) -> torch.optim.AdamW:
    """Decay pulls weights towards zero; on gains (norm scales) and biases that only shifts the
    function, so, as in GPT-2 and nanoGPT, only parameters with two or more dimensions decay."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps)


def lr_factor(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (counting from 0): linear
    warm-up to 1, then a half cosine down to `min_lr_ratio` at `max_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig,
                   max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, config.warmup_steps, max_steps, config.min_lr_ratio))
