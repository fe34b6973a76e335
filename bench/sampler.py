#!/usr/bin/env python
"""The sampler's cost per decode step on the CPU, beside the Hugging Face logits warpers + multinomial
a user would otherwise run, in one run.

    python bench/sampler.py                       # vocabularies 32000 and 49152, 1 and 16 rows
    python bench/sampler.py --vocab 32000 --rows 16 --repeats 50

For each setting (greedy; temperature 0.8; top-p 0.9; top-k 40; logprobs) on random logits, both
flat (randn) and peaked (randn x 6, closer to a trained model's), milliseconds per call: kvik's
Sampler on SamplingParams, and transformers' TemperatureLogitsWarper / TopPLogitsWarper /
TopKLogitsWarper followed by softmax and torch.multinomial (argmax for greedy, log_softmax + topk for
logprobs). Medians over the repeats; ratio > 1: kvik faster.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

import torch

SETTINGS = {
    "greedy": {"temperature": 0.0},
    "T=0.8": {"temperature": 0.8},
    "top_p=0.9": {"temperature": 0.8, "top_p": 0.9},
    "top_k=40": {"temperature": 0.7, "top_k": 40},
    "logprobs=1": {"temperature": 1.0, "logprobs": 1},
}


def hf_step(setting: dict[str, Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    temperature = setting.get("temperature", 1.0)
    if temperature == 0.0:
        return lambda logits: logits.argmax(dim=-1)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if "top_p" in setting:
        warpers.append(TopPLogitsWarper(setting["top_p"]))
    if "top_k" in setting:
        warpers.append(TopKLogitsWarper(setting["top_k"]))

    def step(logits: torch.Tensor) -> torch.Tensor:
        scores = warpers(None, logits)
        tokens = torch.multinomial(scores.softmax(dim=-1), 1).squeeze(1)
        if "logprobs" in setting:
            logprobs = logits.log_softmax(dim=-1)
            logprobs.gather(1, tokens[:, None])
            logprobs.topk(setting["logprobs"], dim=-1)
        return tokens

    return step


def kvik_step(setting: dict[str, Any], rows: int, vocab: int) -> Callable[[torch.Tensor], Any]:
    from kvik import SamplingParams
    from kvik.engine.request import Request, RequestGroup
    from kvik.engine.sampler import Sampler

    sampler = Sampler(vocab, [], torch.device("cpu"))
    params = SamplingParams(**setting)
    requests = []
    for i in range(rows):
        group = RequestGroup(f"r{i}", [1, 2, 3], params, arrival_time=0.0)
        requests.append(Request(seq_id=f"r{i}#0", group=group, index=0, params=params, max_tokens=16,
                                all_token_ids=[1, 2, 3], num_prompt_tokens=3, arrival_order=i))
    return lambda logits: sampler(logits, requests)


def median_ms(step: Callable[[torch.Tensor], Any], logits: torch.Tensor, repeats: int) -> float:
    for _ in range(3):
        step(logits)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step(logits)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def positive_ints(text: str) -> list[int]:
    """argparse type: "32000,49152" -> [32000, 49152], each at least 1."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated whole numbers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers of at least 1")
    return values


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", default="32000,49152", type=positive_ints,
                        help="vocabulary sizes, comma-separated")
    parser.add_argument("--rows", default="1,16", type=positive_ints,
                        help="rows per call (the decode batch), comma-separated")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    print(f"threads: {torch.get_num_threads()}")
    print(f"{'vocab':>6} {'rows':>4} {'logits':<7} {'setting':<11} {'kvik ms':>8} {'HF ms':>8} {'ratio':>6}")
    generator = torch.Generator().manual_seed(0)
    for vocab in args.vocab:
        for rows in args.rows:
            for shape, scale in (("flat", 1.0), ("peaked", 6.0)):
                logits = torch.randn(rows, vocab, generator=generator) * scale
                for name, setting in SETTINGS.items():
                    ours = median_ms(kvik_step(setting, rows, vocab), logits, args.repeats)
                    theirs = median_ms(hf_step(setting), logits, args.repeats)
                    print(f"{vocab:>6} {rows:>4} {shape:<7} {name:<11} {ours:8.3f} {theirs:8.3f} "
                          f"{theirs / ours:5.1f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
