"""Decode speed on a GPU: kvik with CUDA graphs, kvik eager (--enforce-eager) and HF transformers'
`generate`, on the same card, model and dtype, at several batch sizes.

    python bench/decode_graphs.py --model DIR [--dtype bfloat16] [--batch-sizes 1,16,64]
                                  [--prompt-len 128] [--tokens 256] [--kv-cache-memory 8GiB] [--json OUT]

Each figure is decode tokens per second over the steps after the prompts: kvik times its engine's
steps (scheduling, sampling and detokenizing included) once every sequence has its first token; HF
times `generate` for `tokens` new tokens minus one for a single token (the prefill). Every system
runs twice and reports its second run, so kvik's graphs are recorded (and both warmed up) before
the timed run. Needs a CUDA device (`--device cpu` only checks the script: graphs are CUDA's).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from sampler import positive_ints  # bench/sampler.py, beside this script

from kvik.bench.offline import synchronize



def kvik_decode(model: str, device: str, dtype: str, batches: list[int], prompt_len: int, tokens: int,
                eager: bool, kv_memory: int) -> dict[int, float]:
    """Decode tok/s of kvik at each batch size (one engine for all of them)."""
    from kvik import LLM, SamplingParams
    from kvik.bench.offline import model_vocab_size

    # Single steps: each engine.step() below is one forward of the batch, graphed or eager
    # (multi-step decoding would make a step several of them).
    llm = LLM(model, show_progress=False, device=device, dtype=dtype, enforce_eager=eager,
              max_num_seqs=max(batches), kv_cache_memory=kv_memory, num_scheduler_steps=1)
    engine, scheduler = llm.engine, llm.engine.core.scheduler
    vocab = model_vocab_size(model)
    generator = torch.Generator().manual_seed(0)
    rates: dict[int, float] = {}
    for batch in batches:
        for attempt in range(2):
            for i in range(batch):
                prompt = torch.randint(3, vocab, (prompt_len,), generator=generator).tolist()
                engine.add_request(f"{batch}-{attempt}-{i}", prompt,
                                   SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True))
            while scheduler.waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
                engine.step()
            synchronize(device)
            started = time.perf_counter()
            for _ in range(tokens):
                engine.step()
            synchronize(device)
            rates[batch] = batch * tokens / (time.perf_counter() - started)
            while engine.has_unfinished_requests():
                engine.step()
    del llm, engine, scheduler
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rates


def hf_decode(model: str, device: str, dtype: str, batches: list[int], prompt_len: int, tokens: int) -> dict[int, float]:
    """Decode tok/s of HF generate at each batch size: `tokens` new tokens minus one new token."""
    import transformers

    from kvik.bench.offline import model_vocab_size

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()
    vocab = model_vocab_size(model)
    generator = torch.Generator().manual_seed(0)
    rates: dict[int, float] = {}
    for batch in batches:
        ids = torch.randint(3, vocab, (batch, prompt_len), generator=generator).to(device)

        def timed(new: int) -> float:
            synchronize(device)
            started = time.perf_counter()
            with torch.inference_mode():
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                            min_new_tokens=new, do_sample=False, pad_token_id=0)
            synchronize(device)
            return time.perf_counter() - started

        for _ in range(2):
            rates[batch] = batch * (tokens - 1) / (timed(tokens) - timed(1))
    del hf
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu, for a quick check of the script")
    parser.add_argument("--kv-cache-memory", default="8GiB", help="kvik's KV cache budget")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--batch-sizes", default="1,16,64", type=positive_ints, help="comma-separated")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.prompt_len < 1 or args.tokens < 2:
        parser.error("--prompt-len must be at least 1 and --tokens at least 2 (HF's rate is tokens - 1 over "
                     "the time past the first)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench/decode_graphs.py: torch sees no CUDA device (--device cpu checks the script only)")
    from kvik.core.config import parse_bytes

    kv_memory = parse_bytes(args.kv_cache_memory)
    batches = args.batch_sizes
    results: list[dict[str, Any]] = []
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"{name}, {args.model}, {args.dtype}, prompts of {args.prompt_len}, "
          f"{args.tokens} new tokens: decode tok/s", flush=True)
    print("(kvik with graphs, kvik eager, then HF: each loads the model once and runs every batch size)",
          flush=True)
    print(f"{'batch':>6} {'kvik graphs':>12} {'kvik eager':>11} {'HF generate':>12} {'graphs/eager':>13} "
          f"{'graphs/HF':>10}", flush=True)
    common = (args.model, args.device, args.dtype, batches, args.prompt_len, args.tokens)
    graphs = kvik_decode(*common, eager=False, kv_memory=kv_memory)
    eager = kvik_decode(*common, eager=True, kv_memory=kv_memory)
    hf = hf_decode(*common)
    for batch in batches:
        row = {"batch": batch, "kvik_graphs": graphs[batch], "kvik_eager": eager[batch], "hf": hf[batch]}
        results.append(row)
        print(f"{batch:>6} {row['kvik_graphs']:>12.1f} {row['kvik_eager']:>11.1f} {row['hf']:>12.1f} "
              f"{row['kvik_graphs'] / row['kvik_eager']:>12.2f}x {row['kvik_graphs'] / row['hf']:>9.2f}x",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "model": args.model,
                                               "dtype": args.dtype, "prompt_len": args.prompt_len,
                                               "tokens": args.tokens, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
