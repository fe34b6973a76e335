"""Comparisons for the alignment demo: two answers per prompt sampled from the SFT model by kvik's
engine (what `kvik label` shows a person), labelled by three simulated annotators.

Two annotators apply the rule (`--rule keyword`: an answer that mentions sheep beats one that does
not; `--rule shorter`: the answer with fewer words wins; when the rule cannot decide they pick at
random); the third is careless and picks at random 30 % of the time.
Items the rule cannot decide therefore end with low agreement, which `kvik data comparisons
--min-agreement` filters out.
"""

from __future__ import annotations

import argparse
import json
import random

from kvik import LLM, SamplingParams
from kvik.core.comparisons import Comparison, Label, write_comparisons

KEYWORD = "sheep"


def rule_choice(rule: str, responses: list[str], rng: random.Random) -> int:
    if rule == "shorter":
        lengths = [len(r.split()) for r in responses]
        return rng.randrange(2) if lengths[0] == lengths[1] else lengths.index(min(lengths))
    mentions = [KEYWORD in r.lower() for r in responses]
    if mentions[0] != mentions[1]:
        return 0 if mentions[0] else 1
    return rng.randrange(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="the SFT model directory")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--rule", choices=("keyword", "shorter"), default="keyword")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    prompts = [json.loads(line)["prompt"] for line in open(args.prompts)][:args.limit]
    llm = LLM(model=args.model, show_progress=False, kv_cache_memory=256 * 2**20, max_model_len=512,
              device=args.device, dtype="float32")
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    answers = []
    for seed in (1, 2):
        params = [SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=seed * 100_000 + i)
                  for i in range(len(prompts))]
        answers.append([o.outputs[0].text.strip() for o in llm.chat(conversations, params)])
    rng = random.Random(0)
    items = []
    for i, (prompt, a, b) in enumerate(zip(prompts, *answers)):
        if a == b or not a or not b:
            continue
        responses = [a, b]
        labels = []
        for annotator in ("ann-rule-1", "ann-rule-2", "ann-careless"):
            choice = rule_choice(args.rule, responses, rng)
            if annotator == "ann-careless" and rng.random() < 0.3:
                choice = rng.randrange(2)
            labels.append(Label(annotator, (choice,)))
        items.append(Comparison(f"demo-{i}", prompt, tuple(responses), tuple(labels), ("sft", "sft")))
    write_comparisons(args.out, items)
    print(f"wrote {len(items)} comparisons to {args.out}")


if __name__ == "__main__":
    main()
