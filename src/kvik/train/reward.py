"""Task `reward`: a reward model trained on comparisons with the Bradley-Terry loss.

The model is HF's own `AutoModelForSequenceClassification` built from the SFT model (for a Llama:
`LlamaForSequenceClassification`, num_labels=1): the causal LM's trunk and a linear `score` head
read at the last non-padding token. Saved with `save_pretrained`, the output directory is what HF
transformers (or a score endpoint) loads, with the tokenizer beside it. The loss of a pair is
-log sigmoid(r(chosen) - r(rejected)) (InstructGPT, eq. 1); an item with a ranking of K responses
contributes its K-choose-2 pairs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.nn.functional as F

from kvik.train.distributed import all_reduce_sum
from kvik.train.export import copy_tokenizer
from kvik.train.model_setup import load_tokenizer
from kvik.train.preference_data import PairBatch, PairwiseTask, collate_pairs, encode_response, pad_token_id
from kvik.train.task import MicroLoss

if TYPE_CHECKING:
    from kvik.train.trainer import Session


def build_reward_model(init_from: str, tokenizer: Any, lora: Any = None) -> torch.nn.Module:
    """A sequence classifier with one output on the trunk of `init_from` (fresh `score` head)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        init_from, num_labels=1, dtype=torch.float32, pad_token_id=pad_token_id(tokenizer))
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(
            r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules), modules_to_save=["score"], task_type="SEQ_CLS"))
    return model


def pair_rewards(model: torch.nn.Module, batch: PairBatch, autocast: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen rewards (B,), rejected rewards (B,)) in float32."""
    with autocast:
        scores = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    scores = scores.float().squeeze(-1)
    return scores[:batch.num_pairs], scores[batch.num_pairs:]


class RewardTask(PairwiseTask):
    name = "reward"
    evaluate_at_start = True

    def build_model(self) -> torch.nn.Module:
        return build_reward_model(self.config.model.init_from, self.tokenizer, self.config.lora)

    def micro_loss(self, model: torch.nn.Module, batch: PairBatch, autocast: Any) -> MicroLoss:
        chosen, rejected = pair_rewards(model, batch, autocast)
        margin = chosen - rejected
        return MicroLoss(-F.logsigmoid(margin).sum(), {"accuracy": (margin > 0).float().sum(),
                                                       "margin": margin.detach().sum()})

    @torch.no_grad()
    def evaluate(self, s: Session) -> dict[str, float]:
        """Held-out preference accuracy (ties count half) and loss, over every validation pair."""
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, accuracy sum, pairs
        info, size = s.info, self.config.micro_batch_size
        pad = pad_token_id(self.tokenizer)
        mine = self.val_pairs[info.rank::info.world_size]
        for start in range(0, len(mine), size):
            batch = collate_pairs(mine[start:start + size], pad).to(info.device)
            chosen, rejected = pair_rewards(s.model, batch, s.autocast)
            margin = (chosen - rejected).double().cpu()
            totals += torch.stack([-F.logsigmoid(margin).sum(),
                                   (margin > 0).double().sum() + 0.5 * (margin == 0).double().sum(),
                                   torch.tensor(float(len(margin)), dtype=torch.float64)])
        totals = all_reduce_sum(totals.to(info.device), info).cpu()
        return {"val_loss": float(totals[0] / totals[2]), "val_accuracy": float(totals[1] / totals[2]),
                "val_pairs": int(totals[2])}

    def export(self, s: Session, full_state: dict[str, torch.Tensor]) -> list[Path]:
        out = Path(self.config.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        model = self.build_model()
        model.load_state_dict(full_state, strict=True)
        written = []
        if self.config.lora is not None:
            model.peft_config["default"].base_model_name_or_path = str(
                Path(self.config.model.init_from).resolve())
            model.save_pretrained(out / "adapter")
            written.append(out / "adapter")
            model = model.merge_and_unload()
        # A reward model is served and used whole (PPO, `kvik eval`), so the full model is written
        # in every case; with LoRA the adapter is kept beside it.
        model.save_pretrained(out, safe_serialization=True)
        copy_tokenizer(self.tokenizer_dir, out)
        return [out, *written]


class RewardScorer:
    """A trained reward model, for PPO and `kvik eval`: scores (prompt, response) texts, encoded
    exactly as in training."""

    def __init__(self, model_dir: str | Path, device: torch.device, batch_size: int = 16) -> None:
        from transformers import AutoModelForSequenceClassification

        self.tokenizer = load_tokenizer(Path(model_dir))
        self.model = AutoModelForSequenceClassification.from_pretrained(
            str(model_dir), dtype=torch.float32).to(device).eval()
        self.model.requires_grad_(False)
        self.device = device
        self.batch_size = batch_size
        self.pad_id = pad_token_id(self.tokenizer)

    @torch.no_grad()
    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        scores: list[float] = []
        for start in range(0, len(prompts), self.batch_size):
            rows = [encode_response(self.tokenizer, p, r)[0]
                    for p, r in zip(prompts[start:start + self.batch_size],
                                    responses[start:start + self.batch_size])]
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for i, row in enumerate(rows):
                ids[i, :len(row)] = torch.tensor(row)
                mask[i, :len(row)] = 1
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            scores += logits.float().squeeze(-1).tolist()
        return scores
