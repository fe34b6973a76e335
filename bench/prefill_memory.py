#!/usr/bin/env python
"""Prompt throughput with and without the engine's malloc settings (kvik.engine.host_memory), in
alternating processes.

    python bench/prefill_memory.py                          # int4, 16 prompts of 256 tokens, 5 pairs
    python bench/prefill_memory.py --format bfloat16 --prompts 1 --prompt-len 512

Each process loads the reference model (`kvik make-model --size bench`) in the given format and
prefills the batch (max_tokens=1) a few times; one runs with KVIK_MALLOC_TUNING=0 (glibc's
defaults), the other without. Prints each pair's tok/s and the median of the pairs' ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

FORMATS = {"float32": {}, "bfloat16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"},
           "int4": {"quantization": "int4"}}


def child(fmt: str, prompts: int, prompt_len: int, repeats: int) -> None:
    import random
    import time

    from kvik import LLM, SamplingParams
    from kvik.cli.bench import reference_model_path

    llm = LLM(reference_model_path(), show_progress=False, kv_cache_memory=2**30, enable_prefix_caching=False,
              kv_cache_dtype="bfloat16", **FORMATS[fmt])
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rng = random.Random(0)

    def batch() -> list[list[int]]:
        return [[rng.randrange(3, 30000) for _ in range(prompt_len)] for _ in range(prompts)]

    llm.generate(batch(), params)  # warm-up: kernels, the heap's first steps
    times = []
    for _ in range(repeats):
        work = batch()
        start = time.perf_counter()
        llm.generate(work, params)
        times.append(time.perf_counter() - start)
    print(json.dumps({"tok_s": prompts * prompt_len / statistics.median(times)}))


def run_child(args: argparse.Namespace, tuned: bool) -> float:
    env = {**os.environ, "KVIK_MALLOC_TUNING": "1" if tuned else "0"}
    out = subprocess.run([sys.executable, __file__, "--child", "--format", args.format, "--prompts", str(args.prompts),
                          "--prompt-len", str(args.prompt_len), "--repeats", str(args.repeats)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["tok_s"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", choices=sorted(FORMATS), default="int4")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed batches per process (median)")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("prompts", "prompt_len", "repeats", "pairs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.child:
        child(args.format, args.prompts, args.prompt_len, args.repeats)
        return 0
    print(f"{args.format}: {args.prompts} prompts of {args.prompt_len} tokens, {args.pairs} pairs of processes")
    ratios = []
    for index in range(args.pairs):
        first_tuned = index % 2 == 0  # alternate which goes first
        order = [first_tuned, not first_tuned]
        result = {tuned: run_child(args, tuned) for tuned in order}
        ratios.append(result[True] / result[False])
        print(f"  pair {index + 1}: tuned {result[True]:.0f} tok/s, glibc defaults {result[False]:.0f} tok/s, "
              f"{ratios[-1]:.2f}x", flush=True)
    print(f"median ratio {statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
