"""Task `dpo`: direct preference optimisation on comparisons, and its cheap relatives.

With the policy pi and the frozen starting model pi_ref, a response's implicit reward is
beta * (log pi(y|x) - log pi_ref(y|x)) (summed over the response's tokens). Losses per pair:

- sigmoid (DPO, Rafailov et al. 2023): -log sigmoid(r_chosen - r_rejected);
- ipo (Azar et al. 2023): ((h_chosen - h_rejected) - 1 / (2 beta))^2 on the log-ratios h;
- simpo (Meng et al. 2024), no reference model: -log sigmoid(beta * (mean log pi(y_chosen) -
  mean log pi(y_rejected)) - gamma), with per-token means.

The reference is a frozen copy of the starting model, or, with LoRA, the same model with its
adapter switched off (no second copy). Evaluation reports the held-out preference accuracy of the
implicit reward (`val_accuracy`), and of the plain log-likelihood (`val_logp_accuracy`, chosen more
likely than rejected): at step 0 the latter is the SFT model's own preference accuracy, the
baseline DPO must beat.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kvik.train.config import TrainConfig
from kvik.train.distributed import all_reduce_sum
from kvik.train.export import export
from kvik.train.model_setup import build_model
from kvik.train.preference_data import PairBatch, PairwiseTask, collate_pairs, pad_token_id, sequence_logprobs
from kvik.train.task import MicroLoss

if TYPE_CHECKING:
    from kvik.train.trainer import Session


def preference_loss(kind: str, beta: float, gamma: float, policy_chosen: torch.Tensor,
                    policy_rejected: torch.Tensor, ref_chosen: torch.Tensor | None,
                    ref_rejected: torch.Tensor | None, chosen_tokens: torch.Tensor,
                    rejected_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per pair, reward margin per pair) from summed response log-probabilities (B,)."""
    if kind == "simpo":
        margin = beta * (policy_chosen / chosen_tokens - policy_rejected / rejected_tokens)
        return -F.logsigmoid(margin - gamma), margin
    log_ratio = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    if kind == "ipo":
        return (log_ratio - 1 / (2 * beta)) ** 2, beta * log_ratio
    return -F.logsigmoid(beta * log_ratio), beta * log_ratio


class DPOTask(PairwiseTask):
    name = "dpo"
    evaluate_at_start = True

    def __init__(self, config: TrainConfig) -> None:
        super().__init__(config)
        self.reference: torch.nn.Module | None = None
        self._policy: torch.nn.Module | None = None

    def build_model(self) -> torch.nn.Module:
        model = build_model(self.config, self.tokenizer)
        if self.config.lora is None and self.config.dpo.loss != "simpo":
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        return model

    def attach(self, s: Session) -> None:
        self._policy = s.unwrapped
        if self.reference is not None:
            self.reference.to(s.info.device)

    def _reference_context(self) -> contextlib.AbstractContextManager:
        if self.config.lora is not None:
            return self._policy.disable_adapter()
        return contextlib.nullcontext()

    def _logprobs(self, model: torch.nn.Module, batch: PairBatch, autocast: Any) -> torch.Tensor:
        with autocast:
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        return sequence_logprobs(logits, batch.labels)

    def _pair_terms(self, model: torch.nn.Module, batch: PairBatch, autocast: Any):
        policy, tokens = self._logprobs(model, batch, autocast)
        ref = None
        if self.config.dpo.loss != "simpo":
            with torch.no_grad(), self._reference_context():
                ref, _ = self._logprobs(self.reference if self.reference is not None else self._policy,
                                        batch, autocast)
        b = batch.num_pairs
        settings = self.config.dpo
        loss, margin = preference_loss(settings.loss, settings.beta, settings.simpo_gamma,
                                       policy[:b], policy[b:], None if ref is None else ref[:b],
                                       None if ref is None else ref[b:], tokens[:b], tokens[b:])
        return loss, margin, policy[:b] - policy[b:]

    def micro_loss(self, model: torch.nn.Module, batch: PairBatch, autocast: Any) -> MicroLoss:
        loss, margin, _ = self._pair_terms(model, batch, autocast)
        return MicroLoss(loss.sum(), {"accuracy": (margin > 0).float().sum(),
                                      "margin": margin.detach().sum()})

    @torch.no_grad()
    def evaluate(self, s: Session) -> dict[str, float]:
        """Held-out accuracy of the implicit reward and of the log-likelihood (ties count half)."""
        totals = torch.zeros(4, dtype=torch.float64)  # loss, reward accuracy, logp accuracy, pairs
        info, size = s.info, self.config.micro_batch_size
        mine = self.val_pairs[info.rank::info.world_size]
        for start in range(0, len(mine), size):
            batch = collate_pairs(mine[start:start + size], pad_token_id(self.tokenizer)).to(info.device)
            loss, margin, logp_margin = self._pair_terms(s.model, batch, s.autocast)
            margin, logp_margin = margin.double().cpu(), logp_margin.double().cpu()
            totals += torch.stack([
                loss.double().sum().cpu(),
                (margin > 0).double().sum() + 0.5 * (margin == 0).double().sum(),
                (logp_margin > 0).double().sum() + 0.5 * (logp_margin == 0).double().sum(),
                torch.tensor(float(len(margin)), dtype=torch.float64)])
        totals = all_reduce_sum(totals.to(info.device), info).cpu()
        pairs = totals[3]
        return {"val_loss": float(totals[0] / pairs), "val_accuracy": float(totals[1] / pairs),
                "val_logp_accuracy": float(totals[2] / pairs), "val_pairs": int(pairs)}

    def export(self, s: Session, full_state: dict[str, torch.Tensor]) -> list[Path]:
        return export(self.config, full_state, self.tokenizer, self.tokenizer_dir)
