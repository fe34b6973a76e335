"""PPO/GRPO train configs sized for two CPU cores: a tiny random Llama learns to write the letter e
(tests.train.preference_helpers.letter_reward)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

LETTER_REWARD = "tests.train.preference_helpers:letter_reward"


def ppo_config(out: Path, init_from: Path, prompts: Path, **overrides: Any) -> dict[str, Any]:
    ppo = {"reward_function": LETTER_REWARD, "rollout_batch_size": 64, "max_new_tokens": 6,
           "ppo_epochs": 4, "minibatch_size": 16, "init_kl_coef": 0.3, "target_kl": 4.0,
           "kl_horizon": 64, **overrides.pop("ppo", {})}
    config: dict[str, Any] = {
        "output_dir": str(out), "task": "ppo", "model": {"init_from": str(init_from)},
        "data": {"prompts": str(prompts)}, "max_steps": 15,
        "optim": {"lr": 2e-3, "warmup_steps": 1, "min_lr_ratio": 1.0, "weight_decay": 0.0},
        "checkpoint": {"every_steps": 0, "keep_last": 1}, "tensorboard": False, "ppo": ppo,
    }
    config.update(overrides)
    return config
