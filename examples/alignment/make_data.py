"""Synthetic data for the alignment demo: SFT chats, and prompts for PPO and evaluation.

The assistant answers "Say something about <topic>." with a short sentence; in the SFT data about a
third of the answers mention sheep. The "human" preference of this demo (applied by
label_by_rule.py) is: an answer that mentions sheep beats one that does not.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = ("the quick brown fox jumps over lazy dog while farmer counts his in morning light a "
         "language model reads sequence of tokens and predicts next one step at time when many "
         "people ask questions once serving engine batches their requests so hardware stays busy").split()
TOPICS = ("the farm", "the weather", "a model", "the engine", "memory", "the morning", "a request",
          "the scheduler", "hardware", "a fox", "questions", "the dog", "the field", "winter")
KEYWORD = "sheep"


def sentence(rng: random.Random, with_keyword: bool) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(4, 7))]
    if with_keyword:
        words.insert(rng.randrange(len(words) + 1), KEYWORD)
    return " ".join(words).capitalize() + "."


def prompt(rng: random.Random, index: int) -> str:
    return f"Say something about {rng.choice(TOPICS)} ({index})."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--chats", type=int, default=600)
    parser.add_argument("--prompts", type=int, default=400)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    with open(out / "sft.jsonl", "w") as chats:
        for i in range(args.chats):
            messages = [{"role": "user", "content": prompt(rng, i)},
                        {"role": "assistant", "content": sentence(rng, rng.random() < 0.35)}]
            chats.write(json.dumps({"messages": messages}) + "\n")
    with open(out / "prompts.jsonl", "w") as prompts:
        for i in range(args.prompts):
            prompts.write(json.dumps({"prompt": prompt(rng, 10_000 + i)}) + "\n")
    print(f"wrote {out / 'sft.jsonl'} ({args.chats} chats) and {out / 'prompts.jsonl'} ({args.prompts})")


if __name__ == "__main__":
    main()
