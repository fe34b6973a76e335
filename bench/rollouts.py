"""Rollout generation for RL: kvik's engine against HF transformers' `generate`, on the same
prompts, the same number of sampled tokens per rollout, in one run.

    .venv/bin/python bench/rollouts.py [--size small] [--model DIR] [--rollouts 64]
                                       [--new-tokens 32] [--pairs 2] [--json]

Both sides sample (temperature 1, no top-k/top-p) exactly --new-tokens tokens for each of
--rollouts prompts (end-of-sequence ignored), in one batch: kvik through `LLM.generate` (paged KV,
continuous batching), HF through one left-padded `generate` call with its KV cache. Runs alternate
A B A B; the ratio of generated tokens per second is reported per pair and as the median.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

TOPICS = ("the farm", "the weather", "a model", "the engine", "memory", "the morning", "a request",
          "the scheduler", "hardware", "a fox", "questions", "the dog")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", help="kvik make-model size when no --model")
    parser.add_argument("--model", default=None, help="an HF model directory with a chat template")
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvik import LLM, SamplingParams
    from kvik.model.make_model import make_model

    scratch = Path(tempfile.mkdtemp(prefix="kvik-rollouts-"))
    try:
        model_dir = Path(args.model) if args.model else make_model(scratch / "model", "llama", args.size)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Say something about "
                                                 f"{TOPICS[i % len(TOPICS)]} ({i})."}], tokenize=False,
                                               add_generation_prompt=True) for i in range(args.rollouts)]
        prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        device = torch.device(args.device)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
        llm = LLM(str(model_dir), device=args.device, dtype="float32", show_progress=False,
                  max_num_seqs=args.rollouts, kv_cache_memory=512 * 2**20)
        params = [SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=i)
                  for i in range(args.rollouts)]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        ids, mask = ids.to(device), mask.to(device)

        def run_kvik() -> int:
            outputs = llm.generate(prompts, params)
            return sum(len(o.outputs[0].token_ids) for o in outputs)

        def run_hf() -> int:
            torch.manual_seed(0)
            with torch.no_grad():
                out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                                  top_k=0, top_p=1.0, max_new_tokens=args.new_tokens,
                                  min_new_tokens=args.new_tokens, pad_token_id=pad)
            return (out.shape[1] - width) * out.shape[0]

        run_kvik(), run_hf()  # warm-up: kernels, allocator
        kvik_rates, hf_rates = [], []
        for _ in range(args.pairs):
            for rates, fn in ((kvik_rates, run_kvik), (hf_rates, run_hf)):
                started = time.perf_counter()
                tokens = fn()
                rates.append(tokens / (time.perf_counter() - started))
        result = {"model": str(args.model or f"make-model llama {args.size}"),
                  "parameters": sum(p.numel() for p in hf.parameters()), "rollouts": args.rollouts,
                  "new_tokens": args.new_tokens, "device": args.device, "threads": torch.get_num_threads(),
                  "kvik_tokens_per_s": kvik_rates, "hf_tokens_per_s": hf_rates,
                  "speedup_median": statistics.median(k / h for k, h in zip(kvik_rates, hf_rates))}
        if args.json:
            print(json.dumps(result, indent=2))
            return
        print(f"{result['model']} ({result['parameters'] / 1e6:.1f}M params), {args.rollouts} rollouts x "
              f"{args.new_tokens} sampled tokens on {args.device}, {os.cpu_count()} CPUs")
        for i, (k, h) in enumerate(zip(kvik_rates, hf_rates)):
            print(f"pair {i}: kvik {k:8.1f} tok/s   HF generate {h:8.1f} tok/s   x{k / h:.2f}")
        print(f"median: kvik generates rollouts x{result['speedup_median']:.2f} as fast as HF generate")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
