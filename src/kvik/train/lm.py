"""Tasks `pretrain` and `sft`: next-token cross-entropy, on token shards or on chat JSONL (loss on
the assistant's tokens only)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kvik.train.batches import Batch
from kvik.train.config import TrainConfig
from kvik.train.export import export
from kvik.train.flops import matmul_params, training_flops_per_token
from kvik.train.model_setup import build_model, check_tokenizer_matches, load_tokenizer
from kvik.train.pretrain_data import PretrainSamples
from kvik.train.sft_data import SFTSamples, read_conversations
from kvik.train.shards import open_dataset
from kvik.train.task import MicroLoss, SupervisedTask

if TYPE_CHECKING:
    from kvik.train.trainer import Session


def lm_loss_sum(model: torch.nn.Module, batch: Batch, autocast: Any) -> torch.Tensor:
    """Summed next-token cross-entropy over the batch's labelled positions (fp32 logits)."""
    with autocast:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch.labels.flatten(), ignore_index=-100,
                           reduction="sum")


class LanguageModelTask(SupervisedTask):
    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.name = config.task
        self.val_samples: PretrainSamples | None = None
        if config.task == "sft":
            self.tokenizer_dir = Path(config.model.init_from)
            self.tokenizer = load_tokenizer(self.tokenizer_dir)
            self.train_samples = SFTSamples(self.tokenizer, read_conversations(config.data.sft_path),
                                            config.data.seq_len, config.seed)
            return
        dataset = open_dataset(config.data.shards)  # refuses shards whose sha256 does not match
        if config.model.init_from:
            check_tokenizer_matches(Path(config.model.init_from), dataset.tokenizer_dir)
        val_stream = dataset.splits.get("val")
        if val_stream is not None and len(val_stream) > config.data.seq_len:
            self.val_samples = PretrainSamples(val_stream, config.data.seq_len, config.seed,
                                               shuffle=False)
        self.train_samples = PretrainSamples(dataset.splits["train"], config.data.seq_len, config.seed)
        self.tokenizer_dir = dataset.tokenizer_dir
        self.tokenizer = load_tokenizer(dataset.tokenizer_dir)
        self.data_version = dataset.version

    def build_model(self) -> torch.nn.Module:
        return build_model(self.config, self.tokenizer)

    def flops_per_token(self, model: torch.nn.Module) -> float | None:
        return training_flops_per_token(model.config, matmul_params(model), self.config.data.seq_len)

    def count(self, batch: Batch) -> int:
        return batch.num_label_tokens

    def micro_loss(self, model: torch.nn.Module, batch: Batch, autocast: Any) -> MicroLoss:
        return MicroLoss(lm_loss_sum(model, batch, autocast), {})

    def has_evaluation(self) -> bool:
        return self.val_samples is not None

    @torch.no_grad()
    def evaluate(self, s: Session) -> dict[str, float]:
        """Mean loss over the same first validation windows every time, split across ranks."""
        from kvik.train.distributed import all_reduce_sum

        totals = torch.zeros(2, dtype=torch.float64)  # (loss sum, tokens)
        mbs, info = self.config.micro_batch_size, s.info
        for i in range(self.config.eval_batches):
            start = (i * info.world_size + info.rank) * mbs
            batch = self.val_samples.batch(range(start, start + mbs)).to(info.device)
            totals[0] += float(lm_loss_sum(s.model, batch, s.autocast))
            totals[1] += batch.num_label_tokens
        totals = all_reduce_sum(totals.to(info.device), info).cpu()
        return {"val_loss": float(totals[0] / totals[1])}

    def export(self, s: Session, full_state: dict[str, torch.Tensor]) -> list[Path]:
        return export(self.config, full_state, self.tokenizer, self.tokenizer_dir)
