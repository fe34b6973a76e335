"""Multi-LoRA throughput: a batch whose requests use 8 different adapters against the same batch on
the base model alone, paired in one run.

    .venv/bin/python bench/multi_lora.py [--size small] [--requests 32] [--max-tokens 64] [--rounds 2]

The model is a random-weight Llama written by `kvik make-model` (--size, or --model DIR), the
adapters random PEFT LoRA adapters of --rank on every projection (q/k/v/o, gate/up/down), written by
PEFT's save_pretrained: throughput does not depend on what an adapter learned. Arms, alternating
which goes first each round (A B, B A, ...) to spread the machine's noise:
- base: an engine without --enable-lora, every request on the base model;
- mixed: an engine with --enable-lora --max-loras 8, requests round-robin over the 8 adapters (every
  step carries all of them);
- lora-engine-base (reported, not part of the ratio): the LoRA engine serving base requests, i.e. what
  the wrappers cost when no token uses an adapter.
Output tokens per second of each arm and the ratio mixed / base (issue 13's target: >= 70 %).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

NUM_ADAPTERS = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def prepare(cache: Path, size: str, rank: int, model: str | None) -> tuple[Path, dict[str, str]]:
    from kvik.model.make_model import make_model

    base = Path(model) if model else cache / f"model-{size}"
    if not model and not (base / "config.json").is_file():
        make_model(base, "llama", size)
    adapters = {}
    for i in range(NUM_ADAPTERS):
        out = cache / f"{base.name}-adapter{i}-r{rank}"
        if not (out / "adapter_model.safetensors").is_file():
            write_adapter(base, out, seed=i, rank=rank)
        adapters[f"a{i}"] = str(out)
    return base, adapters


def write_adapter(base: Path, out: Path, *, seed: int, rank: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                      init_lora_weights=False, task_type="CAUSAL_LM"))
    model.save_pretrained(out)


def run_arm(llm, prompts: list[list[int]], max_tokens: int, names: list[str | None]) -> tuple[float, int]:
    from kvik.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, lora=names)
    elapsed = time.perf_counter() - started
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Llama-family model directory (default: make-model --size)")
    parser.add_argument("--size", default="small", choices=("tiny", "small", "bench"))
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32, help="requests per arm and round (one batch)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print one JSON line of results")
    args = parser.parse_args(argv)

    from kvik.engine.llm import LLM

    cache = Path(os.environ.get("KVIK_CACHE_DIR", Path.home() / ".cache" / "kvik")) / "bench-multi-lora"
    base, adapters = prepare(cache, args.size, args.rank, args.model)
    common = {"kv_cache_memory": "256MiB", "max_num_seqs": args.requests, "show_progress": False,
              "threads": args.threads}
    engines = {"base": LLM(str(base), **common),
               "lora": LLM(str(base), enable_lora=True, lora_modules=adapters, max_loras=NUM_ADAPTERS,
                           max_lora_rank=args.rank, **common)}
    prompts = [[(7 * i + j) % 400 + 3 for j in range(args.prompt_len)] for i in range(args.requests)]
    mixed_names = [f"a{i % NUM_ADAPTERS}" for i in range(args.requests)]
    arms = {"base": (engines["base"], [None] * args.requests),
            "mixed": (engines["lora"], mixed_names),
            "lora-engine-base": (engines["lora"], [None] * args.requests)}
    for engine, names in arms.values():  # warm-up: first-call costs out of the measurement
        run_arm(engine, prompts[:NUM_ADAPTERS], 4, names[:NUM_ADAPTERS])
    results: dict[str, list[float]] = {name: [] for name in arms}
    order = list(arms)
    for round_index in range(args.rounds):
        for name in order if round_index % 2 == 0 else order[::-1]:
            engine, names = arms[name]
            elapsed, tokens = run_arm(engine, prompts, args.max_tokens, names)
            results[name].append(tokens / elapsed)
            print(f"round {round_index + 1} {name:>17}: {tokens / elapsed:8.1f} output tok/s", flush=True)
    summary = {name: statistics.median(values) for name, values in results.items()}
    ratio = summary["mixed"] / summary["base"]
    paired = [m / b for m, b in zip(results["mixed"], results["base"])]  # same round, next to each other
    print(f"\nmodel {base.name}, {NUM_ADAPTERS} adapters of rank {args.rank}, {args.requests} requests x "
          f"{args.max_tokens} tokens, {args.rounds} paired rounds (median tok/s)")
    for name, value in summary.items():
        print(f"  {name:>17}: {value:8.1f} tok/s")
    print(f"  mixed / base: {ratio:.1%} of medians; per round {', '.join(f'{r:.1%}' for r in paired)} "
          f"(target >= 70%)")
    if args.json:
        print(json.dumps({"tok_s": summary, "ratio": ratio, "paired_ratios": paired, "rounds": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
