"""Synthetic preference data with a known rule, for the reward, DPO and PPO tests.

Responses are short random sentences over a fixed word list; in each pair exactly one response
mentions the keyword, and the annotators prefer that one (two follow the rule, a third is noisy so
the agreement statistics have something to measure). A model that learns the rule ranks held-out
pairs correctly; one that did not is at chance.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from kvik.core.comparisons import Comparison, Label, write_comparisons

KEYWORD = "sheep"
WORDS = ("the quick brown fox jumps over lazy dog while farmer counts his in morning light a "
         "language model reads sequence of tokens and predicts next one step at time when many "
         "people ask questions once serving engine batches their requests so hardware stays busy").split()
TOPICS = ("the farm", "the weather", "a model", "the engine", "memory", "the morning", "a request",
          "the scheduler", "hardware", "a fox", "questions", "the dog")


def _sentence(rng: random.Random, with_keyword: bool) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(4, 7))]
    if with_keyword:
        words.insert(rng.randrange(len(words) + 1), KEYWORD)
    return " ".join(words).capitalize() + "."


def keyword_comparisons(count: int, seed: int = 0, noisy_annotator_flips: float = 0.2) -> list[Comparison]:
    rng = random.Random(seed)
    items = []
    for i in range(count):
        good, bad = _sentence(rng, True), _sentence(rng, False)
        responses = [good, bad] if rng.random() < 0.5 else [bad, good]
        best = responses.index(good)
        noisy = best if rng.random() >= noisy_annotator_flips else 1 - best
        labels = (Label("rule-a", (best,)), Label("rule-b", (best,)), Label("noisy", (noisy,)))
        prompt = f"Say something about {rng.choice(TOPICS)} ({i})."
        items.append(Comparison(f"k{i}", prompt, tuple(responses), labels))
    return items


def write_keyword_comparisons(path: Path, count: int, seed: int = 0) -> Path:
    write_comparisons(path, keyword_comparisons(count, seed))
    return path


def write_prompts(path: Path, count: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path.write_text("".join(json.dumps({"prompt": f"Say something about {rng.choice(TOPICS)} ({i})."}) + "\n"
                            for i in range(count)))
    return path


def keyword_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """A programmatic reward: 1 for every keyword in the response (at most 3), for PPO tests."""
    return [float(min(3, response.lower().count(KEYWORD))) for response in responses]


def letter_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """A dense programmatic reward for PPO tests: how many times the response writes the letter e
    (a random tiny model writes 3-4 in 16 tokens; a policy can learn to write little else)."""
    return [float(response.lower().count("e")) for response in responses]
