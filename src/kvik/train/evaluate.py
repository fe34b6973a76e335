"""`kvik eval winrate`: how often the reward model prefers the policy's answer to the reference's.

Each side is a model directory (generated offline by kvik's engine) or the URL of an
OpenAI-compatible server such as `kvik serve` (its /v1/chat/completions, so the server applies the
chat template exactly as for any client). Both answer the same held-out prompts with the same
sampling settings; the reward model scores each (prompt, answer) pair; a win counts 1, a tie (equal
scores, e.g. identical answers) 1/2. The 95 % interval is Wilson's score interval on the number of
prompts (ties counted as half a win).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch

from kvik.core.errors import ConfigError


@dataclass(frozen=True, slots=True)
class WinRate:
    prompts: int
    wins: int
    ties: int
    losses: int
    win_rate: float  # (wins + ties / 2) / prompts
    interval: tuple[float, float]  # 95 % Wilson score interval
    policy_mean_reward: float
    reference_mean_reward: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def wilson_interval(successes: float, total: int, z: float = 1.96) -> tuple[float, float]:
    if total == 0:
        return (0.0, 1.0)
    p = successes / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return (max(0.0, centre - half), min(1.0, centre + half))


def win_rate(policy_scores: Sequence[float], reference_scores: Sequence[float]) -> WinRate:
    wins = sum(p > r for p, r in zip(policy_scores, reference_scores))
    ties = sum(p == r for p, r in zip(policy_scores, reference_scores))
    n = len(policy_scores)
    rate = (wins + ties / 2) / n if n else math.nan
    return WinRate(n, wins, ties, n - wins - ties, rate, wilson_interval(wins + ties / 2, n),
                   sum(policy_scores) / n if n else math.nan,
                   sum(reference_scores) / n if n else math.nan)


def _answers_from_server(url: str, prompts: Sequence[str], max_tokens: int, temperature: float,
                         seed: int, model: str | None) -> list[str]:
    import httpx

    base = url.rstrip("/")
    base = base if base.endswith("/v1") else f"{base}/v1"
    answers = []
    with httpx.Client(timeout=120) as client:
        if model is None:
            listed = client.get(f"{base}/models")
            listed.raise_for_status()
            model = listed.json()["data"][0]["id"]
        for i, prompt in enumerate(prompts):
            response = client.post(f"{base}/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": temperature, "seed": seed + i})
            if response.status_code != 200:
                raise ConfigError(f"{url}: HTTP {response.status_code}: {response.text[:300]}")
            answers.append(response.json()["choices"][0]["message"]["content"] or "")
    return answers


def _answers_offline(model_dir: str, prompts: Sequence[str], max_tokens: int, temperature: float,
                     seed: int) -> list[str]:
    from kvik.core.sampling_params import SamplingParams
    from kvik.engine.llm import LLM

    llm = LLM(model=model_dir, dtype="float32", show_progress=False, seed=seed)
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i)
              for i in range(len(prompts))]
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    if not getattr(llm.tokenizer, "chat_template", None):
        return [o.outputs[0].text for o in llm.generate(list(prompts), params)]
    return [o.outputs[0].text for o in llm.chat(conversations, params)]


def answers(source: str, prompts: Sequence[str], *, max_tokens: int, temperature: float, seed: int,
            served_model: str | None = None) -> list[str]:
    """Answers of a model directory or of an OpenAI-compatible server URL."""
    if source.startswith(("http://", "https://")):
        return _answers_from_server(source, prompts, max_tokens, temperature, seed, served_model)
    if not Path(source).is_dir():
        raise ConfigError(f"{source}: neither a model directory nor an http(s) URL")
    return _answers_offline(source, prompts, max_tokens, temperature, seed)


def evaluate_win_rate(policy: str, reference: str, reward_model: str, prompts: Sequence[str], *,
                      max_tokens: int = 64, temperature: float = 0.0, seed: int = 0,
                      out_dir: Path | None = None) -> WinRate:
    from kvik.train.reward import RewardScorer

    if not prompts:
        raise ConfigError("no prompts to evaluate on")
    policy_answers = answers(policy, prompts, max_tokens=max_tokens, temperature=temperature, seed=seed)
    reference_answers = answers(reference, prompts, max_tokens=max_tokens, temperature=temperature,
                                seed=seed)
    scorer = RewardScorer(reward_model, torch.device("cpu"))
    policy_scores = scorer.score(prompts, policy_answers)
    reference_scores = scorer.score(prompts, reference_answers)
    result = win_rate(policy_scores, reference_scores)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "winrate.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n")
        with open(out_dir / "winrate_samples.jsonl", "w", encoding="utf-8") as samples:
            for row in zip(prompts, policy_answers, policy_scores, reference_answers, reference_scores):
                samples.write(json.dumps(dict(zip(("prompt", "policy", "policy_reward", "reference",
                                                   "reference_reward"), row)), ensure_ascii=False) + "\n")
    return result
