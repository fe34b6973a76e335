"""The arithmetic of PPO and GRPO on response-aligned tensors (B, L) with a mask of real tokens.

Conventions follow InstructGPT / Ziegler et al. (2019) as TRL and OpenRLHF implement them: the
per-token reward is -kl_coef * (log pi_old - log pi_ref) at every response token, plus the scalar
score at the last one; advantages are GAE over the response; both are computed once per iteration
from the rollout's (old) log-probabilities and values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvik.train.distributed import DistInfo, all_reduce_sum


def masked_mean(values: torch.Tensor, mask: torch.Tensor, info: DistInfo | None = None) -> torch.Tensor:
    """Mean of `values` where mask is 1, over all ranks when `info` is given."""
    totals = torch.stack([(values * mask).sum(), mask.sum()]).double()
    if info is not None:
        totals = all_reduce_sum(totals, info)
    return (totals[0] / totals[1].clamp_min(1)).to(values.dtype)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, info: DistInfo | None,
                  shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / std over the masked entries of every rank; shift_mean=False keeps the
    mean (reward whitening rescales without recentring, so a good batch stays good)."""
    mean = masked_mean(values, mask, info)
    variance = masked_mean((values - mean) ** 2, mask, info)
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), each (B, L). Beyond a response's last token, value and reward are 0,
    so its last token bootstraps from nothing (the episode ends)."""
    values = values * mask
    rewards = rewards * mask
    advantages = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    length = rewards.shape[1]
    for t in reversed(range(length)):
        next_value = values[:, t + 1] if t + 1 < length else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        running = running * mask[:, t]  # positions past the end carry nothing back
        advantages[:, t] = running
    return advantages, advantages + values


def ppo_policy_loss(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, clip_range: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(clipped surrogate loss, clip fraction, approximate KL old->new), masked means."""
    log_ratio = new_logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_range, 1 + clip_range)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    clip_fraction = masked_mean((clipped > unclipped).float(), mask)
    approx_kl = masked_mean(0.5 * log_ratio.detach() ** 2, mask)
    return loss, clip_fraction.detach(), approx_kl


def ppo_value_loss(new_values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                   mask: torch.Tensor, clip_range: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(clipped value loss, value clip fraction)."""
    clipped = old_values + (new_values - old_values).clamp(-clip_range, clip_range)
    unclipped_error = (new_values - returns) ** 2
    clipped_error = (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped_error, clipped_error), mask)
    return loss, masked_mean((clipped_error > unclipped_error).float(), mask).detach()


@dataclass(slots=True)
class AdaptiveKLController:
    """Ziegler et al. (2019): move the coefficient so the mean KL per response approaches
    `target`, by at most +-20 % of its proportional error per `horizon` rollouts."""

    coef: float
    target: float | None  # None: fixed coefficient
    horizon: int

    def update(self, measured_kl: float, num_rollouts: int) -> None:
        if self.target is None:
            return
        error = max(-0.2, min(0.2, measured_kl / self.target - 1))
        self.coef *= 1 + error * num_rollouts / self.horizon


def group_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """GRPO: each response's score standardised within the group of its prompt. scores (B,) with
    the group_size responses of one prompt adjacent."""
    groups = scores.view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True) if group_size > 1 else torch.ones_like(mean)
    return ((groups - mean) / (std + 1e-4)).view(-1)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate exp(r) - r - 1 with r = log pi_ref - log pi (unbiased,
    non-negative; GRPO's penalty)."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1
