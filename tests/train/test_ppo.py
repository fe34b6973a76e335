"""Tasks ppo and grpo on kvik's engine, with a programmatic reward on a tiny random Llama.

- The engine's log-probabilities of the tokens it sampled equal the trainer's recomputation within
  1e-4 (float32) before any update, and after every update too (the weight sync is exact); with a
  temperature, the trainer scores the tokens under softmax(logits / T), the distribution sampled from.
- PPO raises the mean reward clearly while the adaptive controller keeps the measured KL within 2x of
  its target; with the coefficient at 0 the KL grows much further: the penalty is real.
- GRPO raises the reward too; a stopped and resumed PPO run repeats the uninterrupted one exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests.train.ppo_helpers import ppo_config
from tests.train.preference_helpers import write_prompts

from kvik.train.config import train_config_from_dict
from kvik.train.trainer import train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("ppo-prompts") / "prompts.jsonl", 96)


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_equal_the_trainers_before_any_update(tiny_llama: Path, prompts: Path,
                                                              temperature: float) -> None:
    from transformers import AutoModelForCausalLM

    from kvik.train.ppo import collate_rollouts, token_stats
    from kvik.train.preference_data import encode_prompt
    from kvik.train.rollouts import RolloutEngine, read_prompts

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    engine = RolloutEngine(str(tiny_llama), torch.device("cpu"), seed=0, max_model_len=128,
                           engine_args={})
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    texts = read_prompts(prompts)[:16]
    rollouts = engine.generate([encode_prompt(tokenizer, t) for t in texts], list(range(16)), n=2,
                               seeds=list(range(16)), max_new_tokens=12, temperature=temperature)
    batch = collate_rollouts(rollouts, tokenizer.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    stats = token_stats(logits, None, batch, temperature)
    gap = ((stats.raw_logprobs - batch.engine_logprobs) * batch.mask).abs().max()
    assert float(gap) <= 1e-4
    assert batch.mask.sum() > 200
    # The policy-gradient ratio uses the sampled distribution, softmax(logits / T).
    picked = logits.gather(1, batch.positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    expected = torch.log_softmax(picked / temperature, -1).gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(stats.logprobs * batch.mask, expected * batch.mask, atol=1e-6)
    if temperature != 1.0:
        assert not torch.allclose(stats.logprobs * batch.mask, stats.raw_logprobs * batch.mask, atol=1e-3)


@pytest.fixture(scope="module")
def penalised_and_free_runs(tmp_path_factory, tiny_llama: Path, prompts: Path):
    root = tmp_path_factory.mktemp("ppo")
    penalised = ppo_config(root / "penalised", tiny_llama, prompts)
    free = ppo_config(root / "free", tiny_llama, prompts, ppo={"init_kl_coef": 0.0, "target_kl": None})
    train(train_config_from_dict(penalised))
    train(train_config_from_dict(free))
    return _records(root / "penalised"), _records(root / "free"), penalised["ppo"]["target_kl"]


def test_ppo_reward_rises_while_the_kl_stays_near_its_target(penalised_and_free_runs) -> None:
    records, _, target = penalised_and_free_runs
    rewards = [r["reward"] for r in records]
    assert sum(rewards[-3:]) / 3 >= sum(rewards[:3]) / 3 + 0.4, rewards
    late_kl = [r["kl"] for r in records[len(records) // 2:]]
    assert max(late_kl) <= 2 * target, late_kl
    assert all(r["logprob_gap"] <= 1e-4 for r in records), [r["logprob_gap"] for r in records]
    for key in ("entropy", "clip_fraction", "value_loss", "policy_loss", "kl_coef", "sync_s"):
        assert all(key in r for r in records), key
    assert records[-1]["kl_coef"] != records[0]["kl_coef"]  # the controller moved it


def test_without_the_penalty_the_kl_grows_much_further(penalised_and_free_runs) -> None:
    penalised, free, target = penalised_and_free_runs
    assert all(r["kl_coef"] == 0.0 for r in free)
    assert free[-1]["kl"] >= 3 * target
    assert sum(r["kl"] for r in free[-3:]) >= 2 * sum(r["kl"] for r in penalised[-3:])


def test_grpo_raises_the_reward(tmp_path: Path, tiny_llama: Path, prompts: Path) -> None:
    out = tmp_path / "grpo"
    config = ppo_config(out, tiny_llama, prompts, task="grpo", max_steps=10,
                        ppo={"rollout_batch_size": 16, "group_size": 4, "init_kl_coef": 0.05,
                             "target_kl": None})
    result = train(train_config_from_dict(config))
    records = _records(out)
    assert result.finished
    assert sum(r["reward"] for r in records[-3:]) / 3 >= sum(r["reward"] for r in records[:3]) / 3 + 0.5
    assert not (out / "value_head.safetensors").exists()


def test_stop_and_resume_repeats_the_uninterrupted_run(tmp_path: Path, tiny_llama: Path,
                                                       prompts: Path) -> None:
    from transformers import AutoModelForCausalLM

    keys = ("reward", "kl", "kl_coef", "policy_loss", "value_loss")
    straight = ppo_config(tmp_path / "straight", tiny_llama, prompts, max_steps=4,
                          ppo={"rollout_batch_size": 16, "minibatch_size": 8, "ppo_epochs": 2})
    train(train_config_from_dict(straight))
    resumed = {**straight, "output_dir": str(tmp_path / "resumed"),
               "checkpoint": {"every_steps": 2, "keep_last": 1}}
    first = train(train_config_from_dict(resumed), stop_after_steps=2)
    assert first.step == 2 and not first.finished
    second = train(train_config_from_dict(resumed))
    assert second.finished and second.step == 4
    a, b = _records(tmp_path / "straight"), _records(tmp_path / "resumed")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        assert [x[k] for k in keys] == pytest.approx([y[k] for k in keys], rel=1e-5, abs=1e-6)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "resumed").num_parameters() > 0
    assert (tmp_path / "resumed" / "value_head.safetensors").exists()


def test_lora_policy_syncs_merged_weights_into_the_engine(tmp_path: Path, tiny_llama: Path,
                                                          prompts: Path) -> None:
    out = tmp_path / "lora"
    config = ppo_config(out, tiny_llama, prompts, max_steps=3, lora={"r": 4, "alpha": 16},
                        ppo={"rollout_batch_size": 16, "minibatch_size": 8, "ppo_epochs": 2})
    result = train(train_config_from_dict(config))
    assert result.finished
    records = _records(out)
    assert all(r["logprob_gap"] <= 1e-4 for r in records)
    assert records[-1]["kl"] > 0  # the adapter moved the policy, and the engine followed
    assert (out / "adapter_config.json").exists()
