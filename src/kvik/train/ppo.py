"""Tasks `ppo` and `grpo`: the policy samples rollouts on kvik's engine and is optimised against a
reward model or a reward function, kept close to the frozen starting policy by a KL penalty.

One trainer step is one iteration:
1. sync the trainer's policy weights into the rank's engine (in memory) and sample one response per
   prompt (GRPO: `group_size` per prompt), seeded so a resumed run regenerates the same rollouts;
2. score each response; compute, with the rollout's policy, the log-probabilities of the sampled
   tokens (of softmax(logits / temperature), the distribution sampled from), the frozen reference's,
   and (PPO) the value head's estimates;
3. PPO: per-token rewards -kl_coef * (log pi - log pi_ref) plus the score at the last token,
   optionally whitened, GAE advantages (whitened over all ranks) and returns.
   GRPO: each response's score standardised within its prompt's group, for every token;
4. `ppo_epochs` passes over the rollouts in minibatches: clipped surrogate loss, clipped value
   loss (PPO) or the k3 KL estimate against the reference (GRPO); one optimizer step per minibatch;
5. the adaptive KL controller moves the coefficient towards the target KL.

Logged per iteration: reward, kl (per response, nats), kl_coef, entropy, clip_fraction,
value_loss, policy_loss, approx_kl, response_length, logprob_gap (largest |engine - trainer|
log-probability of a sampled token: zero up to float error when the weight sync is right), and the
seconds spent syncing and generating.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kvik.train.batches import EpochShuffle, sample_numbers
from kvik.train.config import TrainConfig
from kvik.train.distributed import all_reduce_sum
from kvik.train.export import export
from kvik.train.model_setup import build_model, load_tokenizer
from kvik.train.preference_data import encode_prompt, pad_token_id
from kvik.train.rl_math import (AdaptiveKLController, gae, group_advantages, k3_kl, masked_mean,
                                masked_whiten, ppo_policy_loss, ppo_value_loss)
from kvik.train.rollouts import (Rollout, RolloutEngine, load_reward_function, read_prompts,
                                 rollout_seed)
from kvik.train.task import Task, clip_and_step

if TYPE_CHECKING:
    from kvik.train.trainer import Session

VALUE_HEAD_FILE = "value_head.safetensors"


class PolicyWithValue(nn.Module):
    """The causal LM and (PPO) a scalar value head on its last hidden state."""

    def __init__(self, policy: nn.Module, with_value_head: bool) -> None:
        super().__init__()
        self.policy = policy
        self.value_head = None
        if with_value_head:
            self.value_head = nn.Linear(policy.config.hidden_size, 1)
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = self.policy(input_ids=input_ids, attention_mask=attention_mask,
                          output_hidden_states=self.value_head is not None)
        values = None
        if self.value_head is not None:
            values = self.value_head(out.hidden_states[-1].float()).squeeze(-1)
        return out.logits, values


@dataclass(slots=True)
class RolloutBatch:
    """A rank's rollouts as padded tensors; response-aligned tensors are (N, L)."""

    input_ids: torch.Tensor  # (N, T) prompt + response, right-padded
    attention_mask: torch.Tensor  # (N, T)
    positions: torch.Tensor  # (N, L): the index in input_ids whose logits predict response token t
    targets: torch.Tensor  # (N, L) response token ids (0 past the end)
    mask: torch.Tensor  # (N, L) float, 1 on real response tokens
    engine_logprobs: torch.Tensor  # (N, L)

    def rows(self, index: torch.Tensor) -> RolloutBatch:
        return RolloutBatch(*(t[index] for t in (self.input_ids, self.attention_mask, self.positions,
                                                 self.targets, self.mask, self.engine_logprobs)))


def collate_rollouts(rollouts: list[Rollout], pad_id: int, device: torch.device) -> RolloutBatch:
    width = max(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)
    length = max(len(r.response_ids) for r in rollouts)
    n = len(rollouts)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    positions = torch.zeros((n, length), dtype=torch.long)
    targets = torch.zeros((n, length), dtype=torch.long)
    mask = torch.zeros((n, length))
    engine_lp = torch.zeros((n, length))
    for i, r in enumerate(rollouts):
        ids = r.prompt_ids + r.response_ids
        input_ids[i, :len(ids)] = torch.tensor(ids)
        attention[i, :len(ids)] = 1
        count = len(r.response_ids)
        positions[i, :count] = torch.arange(len(r.prompt_ids) - 1, len(ids) - 1)
        targets[i, :count] = torch.tensor(r.response_ids)
        mask[i, :count] = 1
        engine_lp[i, :count] = torch.tensor(r.engine_logprobs)
    return RolloutBatch(input_ids.to(device), attention.to(device), positions.to(device),
                        targets.to(device), mask.to(device), engine_lp.to(device))


@dataclass(slots=True)
class TokenStats:
    logprobs: torch.Tensor  # (N, L) of softmax(logits / T)
    raw_logprobs: torch.Tensor  # (N, L) of softmax(logits), what the engine reports
    entropy: torch.Tensor  # (N, L) of softmax(logits / T)
    values: torch.Tensor | None  # (N, L)


def token_stats(logits: torch.Tensor, values: torch.Tensor | None, batch: RolloutBatch,
                temperature: float) -> TokenStats:
    """Response-aligned log-probabilities, entropy and values from a forward over input_ids."""
    vocab = logits.shape[-1]
    picked = logits.float().gather(1, batch.positions.unsqueeze(-1).expand(-1, -1, vocab))
    scaled = torch.log_softmax(picked / temperature, dim=-1)
    logprobs = scaled.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    raw = torch.log_softmax(picked, dim=-1).gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(scaled.exp() * scaled).sum(-1)
    if values is not None:
        values = values.gather(1, batch.positions)
    return TokenStats(logprobs, raw, entropy, values)


class PPOTask(Task):
    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.name = config.task
        self.grpo = config.task == "grpo"
        self.tokenizer_dir = Path(config.model.init_from)
        self.tokenizer = load_tokenizer(self.tokenizer_dir)
        self.prompts = read_prompts(config.data.prompts)
        self.prompt_ids = [encode_prompt(self.tokenizer, p) for p in self.prompts]
        self.order = EpochShuffle(len(self.prompts), config.seed)
        self.kl = AdaptiveKLController(config.ppo.init_kl_coef, config.ppo.target_kl,
                                       config.ppo.kl_horizon)
        self.pad_id = pad_token_id(self.tokenizer)
        self.reference: nn.Module | None = None
        self.engine: RolloutEngine | None = None
        self.engine_is_current = True  # the engine was loaded with the starting weights
        self.reward_function = (load_reward_function(config.ppo.reward_function)
                                if config.ppo.reward_function else None)
        self.scorer: Any = None
        self.last_stats: dict[str, Any] = {}

    # -- set-up --

    def build_model(self) -> nn.Module:
        policy = build_model(self.config, self.tokenizer)
        if self.config.lora is None:
            self.reference = copy.deepcopy(policy).eval().requires_grad_(False)
        return PolicyWithValue(policy, with_value_head=not self.grpo)

    def attach(self, s: Session) -> None:
        info, ppo = s.info, self.config.ppo
        if s.config.ppo.rollout_batch_size % info.world_size:
            from kvik.core.errors import ConfigError

            raise ConfigError(f"ppo.rollout_batch_size: {ppo.rollout_batch_size} does not divide "
                              f"among {info.world_size} processes")
        if self.reference is not None:
            self.reference.to(info.device)
        if ppo.reward_model:
            from kvik.train.reward import RewardScorer

            self.scorer = RewardScorer(ppo.reward_model, info.device)
        max_len = max(len(p) for p in self.prompt_ids) + ppo.max_new_tokens + 1
        self.engine = RolloutEngine(str(self.tokenizer_dir), info.device,
                                    self.config.seed + info.rank, max_len, dict(ppo.engine))

    def close(self) -> None:
        self.engine = None

    def state_dict(self) -> dict[str, Any]:
        return {"kl_coef": self.kl.coef}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "kl_coef" in state:
            self.kl.coef = state["kl_coef"]
        self.engine_is_current = False  # resumed weights differ from the engine's

    # -- one iteration --

    def _reference_context(self, s: Session) -> contextlib.AbstractContextManager:
        if self.reference is None:
            return s.unwrapped.policy.disable_adapter()
        return contextlib.nullcontext()

    def _score(self, rollouts: list[Rollout]) -> torch.Tensor:
        prompts = [self.prompts[r.prompt_index] for r in rollouts]
        texts = [r.text for r in rollouts]
        if self.scorer is not None:
            scores = self.scorer.score(prompts, texts)
        else:
            scores = list(self.reward_function(prompts, texts))
        if len(scores) != len(rollouts):
            from kvik.core.errors import ConfigError

            raise ConfigError(f"the reward function returned {len(scores)} scores for "
                              f"{len(rollouts)} responses")
        return torch.tensor([float(x) for x in scores], dtype=torch.float32)

    def _generate(self, s: Session, step: int) -> list[Rollout]:
        config, info, ppo = self.config, s.info, self.config.ppo
        if not self.engine_is_current:
            self.engine.sync(s.unwrapped.policy)
        per_rank = ppo.rollout_batch_size // info.world_size
        samples = sample_numbers(step, 0, info.rank, info.world_size, per_rank, 1)
        indices = [self.order(n) for n in samples]
        seeds = [rollout_seed(config.seed, step, info.rank, j) for j in range(len(indices))]
        return self.engine.generate([self.prompt_ids[i] for i in indices], indices,
                                    n=ppo.group_size if self.grpo else 1, seeds=seeds,
                                    max_new_tokens=ppo.max_new_tokens, temperature=ppo.temperature)

    @torch.no_grad()
    def _rollout_stats(self, s: Session, batch: RolloutBatch) -> tuple[TokenStats, torch.Tensor]:
        """The rollout policy's token stats and the reference's log-probabilities."""
        size, temperature = self.config.ppo.minibatch_size, self.config.ppo.temperature
        parts, ref_parts = [], []
        model = s.unwrapped
        for start in range(0, batch.input_ids.shape[0], size):
            rows = batch.rows(torch.arange(start, min(start + size, batch.input_ids.shape[0])))
            with s.autocast:
                logits, values = model(rows.input_ids, rows.attention_mask)
            parts.append(token_stats(logits, values, rows, temperature))
            with s.autocast, self._reference_context(s):
                reference = self.reference if self.reference is not None else model.policy
                ref_logits = reference(input_ids=rows.input_ids, attention_mask=rows.attention_mask).logits
            ref_parts.append(token_stats(ref_logits, None, rows, temperature).logprobs)
        joined = TokenStats(*(torch.cat([getattr(p, f) for p in parts]) if getattr(parts[0], f) is not None
                              else None for f in ("logprobs", "raw_logprobs", "entropy", "values")))
        return joined, torch.cat(ref_parts)

    def train_step(self, s: Session, step: int) -> dict[str, Any]:
        info, ppo = s.info, self.config.ppo
        started = time.perf_counter()
        sync_seconds = 0.0 if self.engine_is_current else None
        rollouts = self._generate(s, step)
        if sync_seconds is None:
            sync_seconds = self.engine.last_sync_seconds
        generated = time.perf_counter()
        scores = self._score(rollouts).to(info.device)
        batch = collate_rollouts(rollouts, self.pad_id, info.device)
        old, ref_logprobs = self._rollout_stats(s, batch)
        mask = batch.mask
        kl_per_token = (old.logprobs - ref_logprobs) * mask
        last = (mask.sum(1).long() - 1).clamp_min(0)
        if self.grpo:
            advantages = group_advantages(scores, ppo.group_size)[:, None] * mask
            returns = None
        else:
            rewards = -self.kl.coef * kl_per_token
            rewards[torch.arange(len(rollouts)), last] += scores
            if ppo.whiten_rewards:
                rewards = masked_whiten(rewards, mask, info, shift_mean=False)
            advantages, returns = gae(rewards, old.values, mask, ppo.gamma, ppo.lam)
            advantages = masked_whiten(advantages, mask, info)
        losses = self._optimise(s, step, batch, old, ref_logprobs, advantages, returns)

        n = torch.tensor([float(len(rollouts))], dtype=torch.float64, device=info.device)
        sums = all_reduce_sum(torch.cat([n, torch.stack([
            scores.double().sum(), kl_per_token.double().sum(), mask.double().sum(),
            (old.entropy * mask).double().sum()])]), info)
        gap = (old.raw_logprobs - batch.engine_logprobs).abs().mul(mask).max().double().reshape(1)
        if info.is_distributed:
            import torch.distributed as dist

            dist.all_reduce(gap, op=dist.ReduceOp.MAX)
        count = float(sums[0])
        measured_kl = float(sums[2]) / count
        kl_coef = self.kl.coef
        self.kl.update(measured_kl, int(count))
        self.engine_is_current = False
        self.last_stats = {
            "loss": losses["policy_loss"] + ppo.vf_coef * losses.get("value_loss", 0.0),
            "reward": float(sums[1]) / count, "kl": measured_kl, "kl_coef": kl_coef,
            "entropy": float(sums[4]) / float(sums[3]), "response_length": float(sums[3]) / count,
            **losses, "logprob_gap": float(gap), "lr": s.scheduler.get_last_lr()[0],
            "sync_s": sync_seconds, "generate_s": generated - started,
            "step_time_s": time.perf_counter() - started}
        return self.last_stats

    def _optimise(self, s: Session, step: int, batch: RolloutBatch, old: TokenStats,
                  ref_logprobs: torch.Tensor, advantages: torch.Tensor,
                  returns: torch.Tensor | None) -> dict[str, float]:
        ppo, info = self.config.ppo, s.info
        count = batch.input_ids.shape[0]
        size = min(ppo.minibatch_size, count)
        totals: dict[str, float] = {}
        updates = 0
        for epoch in range(ppo.ppo_epochs):
            generator = torch.Generator().manual_seed(rollout_seed(self.config.seed, step, info.rank,
                                                                   -1 - epoch))
            order = torch.randperm(count, generator=generator)
            for start in range(0, count - size + 1, size):
                index = order[start:start + size].to(batch.input_ids.device)
                rows = batch.rows(index)
                mask = rows.mask
                with s.autocast:
                    logits, values = s.model(rows.input_ids, rows.attention_mask)
                new = token_stats(logits, values, rows, ppo.temperature)
                policy_loss, clip_fraction, approx_kl = ppo_policy_loss(
                    new.logprobs, old.logprobs[index], advantages[index], mask, ppo.clip_range)
                metrics = {"policy_loss": policy_loss.detach(), "clip_fraction": clip_fraction,
                           "approx_kl": approx_kl}
                loss = policy_loss
                if self.grpo:
                    kl_loss = masked_mean(k3_kl(new.logprobs, ref_logprobs[index]), mask)
                    loss = loss + self.kl.coef * kl_loss
                    metrics["kl_loss"] = kl_loss.detach()
                else:
                    value_loss, value_clip = ppo_value_loss(new.values, old.values[index],
                                                            returns[index], mask, ppo.value_clip_range)
                    loss = loss + ppo.vf_coef * value_loss
                    metrics.update(value_loss=value_loss.detach(), value_clip_fraction=value_clip)
                loss.backward()
                grad_norm, _ = clip_and_step(s)
                metrics["grad_norm"] = torch.tensor(grad_norm)
                for key, value in metrics.items():
                    totals[key] = totals.get(key, 0.0) + float(value)
                updates += 1
        stacked = all_reduce_sum(torch.tensor([totals[k] for k in sorted(totals)], dtype=torch.float64,
                                              device=info.device), info)
        return {k: float(v) / (updates * info.world_size) for k, v in zip(sorted(totals), stacked)}

    # -- the result --

    def export(self, s: Session, full_state: dict[str, torch.Tensor]) -> list[Path]:
        from safetensors.torch import save_file

        policy_state = {k.removeprefix("policy."): v for k, v in full_state.items()
                        if k.startswith("policy.")}
        written = export(self.config, policy_state, self.tokenizer, self.tokenizer_dir)
        head = {k.removeprefix("value_head."): v.contiguous() for k, v in full_state.items()
                if k.startswith("value_head.")}
        if head:
            save_file(head, str(Path(self.config.output_dir) / VALUE_HEAD_FILE))
        return written

    def summary(self) -> dict[str, Any]:
        return {key: self.last_stats.get(key) for key in ("reward", "kl", "kl_coef")}


