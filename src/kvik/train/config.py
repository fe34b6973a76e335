"""`train.yaml`: what to train, on what, how long, and where it goes. One dataclass per section."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from kvik.core.config_files import build_dataclass, read_config_file  # noqa: F401 (re-exported)
from kvik.core.errors import ConfigError

TASKS = ("pretrain", "sft", "reward", "dpo", "ppo", "grpo")
DPO_LOSSES = ("sigmoid", "ipo", "simpo")
STRATEGIES = ("ddp", "fsdp")
PRECISIONS = ("auto", "fp32", "bf16")


@dataclass(slots=True)
class ModelConfig:
    # An HF model directory to start from (fine-tuning, continued pretraining); else a fresh
    # model of `type` built from `config` (HF config keys; vocab and special ids come from the
    # tokenizer).
    init_from: str | None = None
    type: str = "llama"
    config: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class DataConfig:
    shards: str | None = None  # pretrain: directory with manifest.json from `kvik data`
    sft_path: str | None = None  # sft: JSONL of {"messages": [{"role", "content"}, ...]}
    # reward, dpo: a directory written by `kvik data comparisons` (train and val splits), or one
    # comparisons JSONL used whole for training
    comparisons: str | None = None
    # ppo, grpo: JSONL whose lines have a "prompt" (a comparisons file or directory will do); the
    # held-out prompts of a comparisons directory are not used for training
    prompts: str | None = None
    seq_len: int = 256  # tokens per sample (longer SFT conversations and pairs are truncated)


@dataclass(slots=True)
class OptimConfig:
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 10
    weight_decay: float = 0.1  # on matrices only; norms, biases and embeddings' vectors none
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float | None = 1.0  # max global grad norm; null turns clipping off


@dataclass(slots=True)
class DistributedConfig:
    strategy: str = "ddp"  # ddp | fsdp (FSDP2 fully_shard, per decoder layer and at the root)
    timeout_s: float = 300.0  # process-group timeout: a dead peer ends a collective, not a hang


@dataclass(slots=True)
class CheckpointConfig:
    every_steps: int = 100  # 0: only at exit
    keep_last: int = 2
    dir: str | None = None  # default: <output_dir>/checkpoints
    resume: bool = True  # continue from the newest checkpoint in `dir` when there is one


@dataclass(slots=True)
class LoraConfig:
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    merge: bool = False  # also write the merged model to `merged_dir`
    merged_dir: str | None = None  # default: <output_dir>/merged


@dataclass(slots=True)
class DPOConfig:
    beta: float = 0.1  # strength of the implicit KL constraint (sigmoid, ipo); SimPO's reward scale
    # sigmoid: DPO (Rafailov et al. 2023); ipo: IPO's squared loss (Azar et al. 2023);
    # simpo: SimPO (Meng et al. 2024), reference-free, length-normalised log-likelihoods
    loss: str = "sigmoid"
    simpo_gamma: float = 0.5  # SimPO's target reward margin


@dataclass(slots=True)
class PPOConfig:
    # Exactly one scorer: a reward model directory (`task: reward` output), or a Python function
    # "package.module:name" / "path/to/file.py:name" called as f(prompts, responses) -> floats.
    reward_model: str | None = None
    reward_function: str | None = None
    rollout_batch_size: int = 16  # prompts per iteration, all ranks together
    max_new_tokens: int = 32
    temperature: float = 1.0  # rollouts sample from softmax(logits / temperature), no top-k/top-p
    ppo_epochs: int = 4  # passes over each iteration's rollouts
    minibatch_size: int = 8  # rollouts per optimizer step, per rank
    clip_range: float = 0.2  # policy ratio clip
    value_clip_range: float = 0.2  # value prediction clip around the rollout's values
    vf_coef: float = 0.1
    gamma: float = 1.0
    lam: float = 0.95  # GAE lambda
    init_kl_coef: float = 0.1  # per-token KL penalty coefficient (GRPO: beta of its KL loss term)
    # Adaptive KL controller (Ziegler et al. 2019): the coefficient moves so that the mean KL per
    # response approaches this many nats; null keeps the coefficient fixed.
    target_kl: float | None = 6.0
    kl_horizon: int = 10000
    whiten_rewards: bool = False  # divide per-token rewards by their batch std before GAE
    group_size: int = 4  # GRPO: responses per prompt
    # Extra arguments of the rollout engine, kvik.LLM (e.g. kv_cache_memory, max_num_seqs).
    engine: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class TrainConfig:
    output_dir: str
    task: str = "pretrain"  # pretrain | sft | reward | dpo | ppo | grpo
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    max_steps: int = 100  # optimizer steps
    micro_batch_size: int = 8  # samples per process per forward
    grad_accum_steps: int = 1
    precision: str = "auto"  # auto: bf16 autocast on a GPU that has it, else fp32
    seed: int = 0
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    lora: LoraConfig | None = None
    dpo: DPOConfig = field(default_factory=DPOConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)  # also grpo's settings
    eval_every: int = 0  # steps between validation losses (0: at the end only, if there is a val split)
    eval_batches: int = 8
    log_every: int = 1
    tensorboard: bool = True
    peak_flops: float | None = None  # per device, for MFU; default: known GPUs, measured on CPU

    def validate(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"task: {self.task!r} is not one of {', '.join(TASKS)}")
        if self.task == "pretrain" and not self.data.shards:
            raise ConfigError("data.shards: pretraining needs the directory written by `kvik data`")
        if self.task == "sft" and not (self.data.sft_path and self.model.init_from):
            raise ConfigError("sft needs data.sft_path (chat JSONL) and model.init_from "
                              "(a model directory with a chat template)")
        if self.task in ("reward", "dpo") and not (self.data.comparisons and self.model.init_from):
            raise ConfigError(f"{self.task} needs data.comparisons (from `kvik data comparisons`) "
                              "and model.init_from (the SFT model to start from)")
        if self.task in ("ppo", "grpo"):
            self._validate_rl()
        if self.dpo.loss not in DPO_LOSSES:
            raise ConfigError(f"dpo.loss: {self.dpo.loss!r} is not one of {', '.join(DPO_LOSSES)}")
        if self.lora is not None and not self.model.init_from:
            raise ConfigError("lora: needs model.init_from, the base model the adapter applies to")
        if self.distributed.strategy not in STRATEGIES:
            raise ConfigError(f"distributed.strategy: {self.distributed.strategy!r} is not one of "
                              f"{', '.join(STRATEGIES)}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision: {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        for name in ("max_steps", "micro_batch_size", "grad_accum_steps", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be at least 1")
        if self.data.seq_len < 2:
            raise ConfigError("data.seq_len: must be at least 2")
        if self.checkpoint.keep_last < 1:
            raise ConfigError("checkpoint.keep_last: must be at least 1")

    def _validate_rl(self) -> None:
        ppo = self.ppo
        if not (self.data.prompts and self.model.init_from):
            raise ConfigError(f"{self.task} needs data.prompts (JSONL with a \"prompt\" per line) and "
                              "model.init_from (the SFT policy)")
        if (ppo.reward_model is None) == (ppo.reward_function is None):
            raise ConfigError("ppo: give exactly one of reward_model (a `task: reward` output "
                              "directory) or reward_function (\"module:function\")")
        if self.distributed.strategy != "ddp":
            raise ConfigError(f"{self.task}: only distributed.strategy ddp is supported")
        for name in ("rollout_batch_size", "max_new_tokens", "ppo_epochs", "minibatch_size",
                     "group_size"):
            if getattr(ppo, name) < 1:
                raise ConfigError(f"ppo.{name}: must be at least 1")
        if ppo.temperature <= 0:
            raise ConfigError("ppo.temperature: must be positive (rollouts are sampled)")
        if ppo.target_kl is not None and ppo.target_kl <= 0:
            raise ConfigError("ppo.target_kl: must be positive, or null for a fixed coefficient")

    def rollouts_per_rank(self, world_size: int) -> int:
        """PPO/GRPO responses each rank generates per iteration."""
        per_rank = self.ppo.rollout_batch_size // world_size
        return per_rank * (self.ppo.group_size if self.task == "grpo" else 1)

    def total_optimizer_steps(self, world_size: int) -> int:
        """Length of the learning-rate schedule: PPO/GRPO take several optimizer steps per
        iteration (epochs x minibatches); other tasks one per step."""
        if self.task not in ("ppo", "grpo"):
            return self.max_steps
        minibatches = max(1, self.rollouts_per_rank(world_size) // self.ppo.minibatch_size)
        return self.max_steps * self.ppo.ppo_epochs * minibatches

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir or Path(self.output_dir) / "checkpoints")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def train_config_from_dict(data: dict[str, Any]) -> TrainConfig:
    config = build_dataclass(TrainConfig, data, "")
    config.validate()
    return config
