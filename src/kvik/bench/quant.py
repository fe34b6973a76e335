"""Narrow weights and KV caches, measured side by side: `python bench/quant_decode.py`.

For each weight format (float32, bfloat16, int8, int4) on the same model, in child processes of their
own, interleaved round by round (A B C D, A B C D, ...) so that slow patches of a shared machine
fall on every format alike:

- single-stream decode tokens/s and the bytes one step reads (every linear weight, plus the KV of the
  context), as a fraction of the read bandwidth measured in reads paired with the steps (the method of
  `kvik bench compare`: each step is followed by a read of as many bytes, and the fraction is total
  read time over total decode time), and again against memory bandwidth as STREAM defines it:
  steps in runs of STEADY_BURST (each in its steady state, as tg128 decodes), then as many reads
  of a buffer of at least 4x the last-level cache, counted pro rata (`paired_decode_steps`);
- prompt throughput: one 512-token prompt, tokens per second;
- ratios of each to float32 in the same round.

Then the KV cache dtypes (float32, bfloat16, int8): tokens per GiB, the number of concurrent 1k-token
sequences a fixed budget holds (the engine's own block count), and, on a trained model, greedy
agreement with the float32 cache and the error of prompt logprobs.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

WEIGHT_FORMATS: dict[str, dict[str, Any]] = {
    # An explicit float32 dequantizes a pre-quantized checkpoint (GPTQ/AWQ/GGUF Q4_*) to float32.
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16", "kv_cache_dtype": "float32"},
    "int8": {"quantization": "int8"},
    "int8-channel": {"quantization": "int8", "quantization_group_size": 0},  # a scale per output channel
    "int4": {"quantization": "int4"},
    # The engine's defaults: a pre-quantized checkpoint's 4-bit layers as int4 from its own codes.
    "checkpoint": {},
}
DEFAULT_FORMATS = ("float32", "bfloat16", "int8", "int4")
STEADY_BURST = 8  # steps, then as many reads, in the second decode measurement
KV_DTYPES = ("float32", "bfloat16", "int8", "fp8")


@dataclass(slots=True)
class QuantBenchConfig:
    model: str
    formats: tuple[str, ...] = DEFAULT_FORMATS
    rounds: int = 3
    decode_tokens: int = 128
    decode_prompt_len: int = 64
    prompt_len: int = 512
    prompt_repeats: int = 3
    kv_budget: int = 2**30  # bytes, for the concurrent-sequences figure
    kv_sequence_len: int = 1024
    kv_dtypes: tuple[str, ...] = KV_DTYPES  # KV capacity figures for these (empty: none)
    quality_model: str | None = None  # a trained model for agreement / logprob error
    out: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def measure_format(model: str, engine_args: dict[str, Any], decode_tokens: int, decode_prompt_len: int,
                   prompt_len: int, prompt_repeats: int) -> dict[str, Any]:
    """One weight format, in this process: paired-read decode, then prompt throughput."""
    from kvik import LLM, SamplingParams
    from kvik.bench.compare import paired_decode_steps, screened_head_discount
    from kvik.model.layers.kv_cache import kv_bytes_per_token
    from kvik.model.transforms.prefetch import last_level_cache_bytes

    llm = LLM(model, show_progress=False, kv_cache_memory=2**30, enable_prefix_caching=False, **engine_args)
    engine, core = llm.engine, llm.engine.core  # the front end steps; the core holds the model
    cfg = core.model_config
    kv_token = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, core.precision.kv_cache_dtype)
    # Step i (0-based) attends decode_prompt_len + i + 2 tokens; the buffer reads their mean.
    mean_context = decode_prompt_len + 1 + (decode_tokens + 1) / 2
    bytes_per_token = int(core.transforms.linear_weight_bytes + kv_token * mean_context
                          + cfg.hidden_size * 4)  # + the embedding row
    bytes_per_token -= screened_head_discount(core)
    llm.generate([[5] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm every path
    decode_times, read_times = paired_decode_steps(engine, decode_prompt_len, decode_tokens, bytes_per_token)
    steady_decode, steady_read = paired_decode_steps(engine, decode_prompt_len, decode_tokens, bytes_per_token,
                                                     burst=STEADY_BURST, min_read_bytes=4 * last_level_cache_bytes())
    generator = torch.Generator().manual_seed(0)
    prompt_seconds = []
    for _ in range(prompt_repeats):
        prompt = torch.randint(10, cfg.vocab_size - 10, (prompt_len,), generator=generator).tolist()
        started = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
        prompt_seconds.append(time.perf_counter() - started)
    return {
        "precision": core.precision.describe(),
        "kernels": core.transforms.kernel_isa,
        "linear_weight_bytes": core.transforms.linear_weight_bytes,
        # Scales, zero points and biases included: int8 is a little over 1, int4 over 0.5.
        "bytes_per_weight": core.transforms.linear_weight_bytes / core.transforms.linear_weights,
        "bytes_per_token": bytes_per_token,
        "decode_tokens_per_second": decode_tokens / sum(decode_times),
        "read_bandwidth": bytes_per_token * decode_tokens / sum(read_times),
        "decode_bandwidth_fraction": sum(read_times) / sum(decode_times),
        "steady_decode_tokens_per_second": decode_tokens / sum(steady_decode),
        "steady_read_bandwidth": bytes_per_token * decode_tokens / sum(steady_read),
        "steady_bandwidth_fraction": sum(steady_read) / sum(steady_decode),
        "prompt_tokens_per_second": prompt_len / statistics.median(prompt_seconds),
    }


def run_child(config: QuantBenchConfig, fmt: str, workdir: Path, round_index: int) -> dict[str, Any]:
    out = workdir / f"quant-{fmt}-{round_index}.json"
    spec = {"model": config.model, "engine_args": WEIGHT_FORMATS[fmt], "decode_tokens": config.decode_tokens,
            "decode_prompt_len": config.decode_prompt_len, "prompt_len": config.prompt_len,
            "prompt_repeats": config.prompt_repeats}
    subprocess.run([sys.executable, "-m", "kvik.bench.quant", "--child", json.dumps(spec), str(out)], check=True)
    return json.loads(out.read_text())


def kv_capacity(model: str, kv_dtype: str, budget: int, sequence_len: int) -> dict[str, Any]:
    """Tokens per GiB and how many sequences of `sequence_len` tokens the engine's pool holds at
    `budget` bytes (read from the engine it builds, not computed beside it)."""
    from kvik import LLM
    from kvik.model.layers.kv_cache import kv_bytes_per_token

    llm = LLM(model, show_progress=False, kv_cache_memory=budget, kv_cache_dtype=kv_dtype,
              max_model_len=sequence_len, max_num_seqs=1024)
    engine = llm.engine.core
    cfg = engine.model_config
    per_token = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, engine.precision.kv_cache_dtype)
    blocks_per_sequence = -(-sequence_len // engine.kv.block_size)
    return {"bytes_per_token": per_token, "tokens_per_gib": 2**30 // per_token,
            "blocks": engine.kv.pool.num_blocks, "allocated_bytes": engine.runner.kv_cache.nbytes,
            "sequences": engine.kv.pool.num_blocks // blocks_per_sequence}


QUALITY_PROMPTS = [
    "ROMEO:\nBut, soft! what light through yonder window breaks?",
    "KING:\nNow is the winter of our discontent",
    "First Witch:\nWhen shall we three meet again",
    "HAMLET:\nTo be, or not to be, that is the question:",
    "JULIET:\nO Romeo, Romeo! wherefore art thou",
    "MACBETH:\nIs this a dagger which I see before me,",
    "PROSPERO:\nOur revels now are ended. These our actors,",
    "VIOLA:\nMake me a willow cabin at your gate,",
]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two generations share before their first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def kv_quality(model: str, kv_dtypes: tuple[str, ...] = KV_DTYPES) -> dict[str, Any]:
    """Greedy agreement (48 tokens from each prompt) and prompt-logprob error of each KV dtype against
    the float32 cache, on a trained model."""
    from kvik import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    scored = SamplingParams(max_tokens=1, prompt_logprobs=0)
    results: dict[str, Any] = {}
    reference_tokens = reference_logprobs = None
    for kv_dtype in kv_dtypes:
        llm = LLM(model, show_progress=False, kv_cache_dtype=kv_dtype)
        tokens = [o.outputs[0].token_ids for o in llm.generate(QUALITY_PROMPTS, greedy)]
        # Score the float32 continuations teacher-forced: prompt + continuation as one prompt.
        texts = [llm.engine.tokenizer.encode(p) + t for p, t in zip(QUALITY_PROMPTS, reference_tokens or tokens)]
        outputs = llm.generate(texts, scored)
        logprobs = [[entry[token].logprob for entry, token in zip(o.prompt_logprobs[1:], ids[1:])]
                    for o, ids in zip(outputs, texts)]
        if reference_tokens is None:
            reference_tokens, reference_logprobs = tokens, logprobs
        errors = [abs(a - b) for got, want in zip(logprobs, reference_logprobs) for a, b in zip(got, want)]
        results[kv_dtype] = {
            "greedy_equal": sum(a == b for a, b in zip(tokens, reference_tokens)),
            "prompts": len(QUALITY_PROMPTS),
            "tokens_before_first_difference": sum(
                common_prefix(a, b) for a, b in zip(tokens, reference_tokens)),
            "logprob_error_mean": sum(errors) / len(errors),
            "logprob_error_max": max(errors),
        }
    return results


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def run(config: QuantBenchConfig) -> dict[str, Any]:
    workdir = Path(config.out or "bench-results").parent if config.out else Path("bench-results")
    workdir.mkdir(parents=True, exist_ok=True)
    rounds: list[dict[str, dict[str, Any]]] = []
    for index in range(config.rounds):
        print(f"== round {index + 1}/{config.rounds}", flush=True)
        rounds.append({fmt: run_child(config, fmt, workdir, index) for fmt in config.formats})
    lines = ["", f"weights ({config.rounds} rounds; median (min-max) over rounds; ratios to float32 of the same "
                 "round):",
             f"  {'format':<9} {'B/weight':>8} {'MB/token':>8} {'decode tok/s':>18} {'x fp32':>18} {'% of paired read':>18} "
             f"{f'tok/s, runs of {STEADY_BURST}':>18} {'% of STREAM read':>18} "
             f"{'prompt tok/s':>20} {'x fp32':>18}"]
    summary: dict[str, Any] = {}
    for fmt in config.formats:
        decode = [r[fmt]["decode_tokens_per_second"] for r in rounds]
        fraction = [100 * r[fmt]["decode_bandwidth_fraction"] for r in rounds]
        steady = [r[fmt]["steady_decode_tokens_per_second"] for r in rounds]
        steady_fraction = [100 * r[fmt]["steady_bandwidth_fraction"] for r in rounds]
        prompt = [r[fmt]["prompt_tokens_per_second"] for r in rounds]
        decode_ratio = [r[fmt]["decode_tokens_per_second"] / r["float32"]["decode_tokens_per_second"]
                        for r in rounds] if "float32" in config.formats else [float("nan")]
        prompt_ratio = [r[fmt]["prompt_tokens_per_second"] / r["float32"]["prompt_tokens_per_second"]
                        for r in rounds] if "float32" in config.formats else [float("nan")]
        summary[fmt] = {"bytes_per_token": rounds[0][fmt]["bytes_per_token"],
                        "bytes_per_weight": rounds[0][fmt]["bytes_per_weight"],
                        "decode_tokens_per_second": decode,
                        "decode_bandwidth_percent": fraction, "prompt_tokens_per_second": prompt,
                        "steady_decode_tokens_per_second": steady, "steady_bandwidth_percent": steady_fraction,
                        "decode_ratio": decode_ratio, "prompt_ratio": prompt_ratio,
                        "read_bandwidth": [r[fmt]["read_bandwidth"] for r in rounds],
                        "precision": rounds[0][fmt]["precision"], "kernels": rounds[0][fmt]["kernels"]}
        lines.append(f"  {fmt:<9} {rounds[0][fmt]['bytes_per_weight']:8.3f} "
                     f"{rounds[0][fmt]['bytes_per_token'] / 1e6:8.1f} {_spread(decode):>18} "
                     f"{_spread(decode_ratio):>18} {_spread(fraction):>18} {_spread(steady):>18} "
                     f"{_spread(steady_fraction):>18} {_spread(prompt):>20} "
                     f"{_spread(prompt_ratio):>18}")
    bandwidths = [r[f]["read_bandwidth"] / 1e9 for r in rounds for f in config.formats]
    lines.append(f"  paired read bandwidth over the run: {min(bandwidths):.1f}-{max(bandwidths):.1f} GB/s")
    steady_bandwidths = [r[f]["steady_read_bandwidth"] / 1e9 for r in rounds for f in config.formats]
    lines.append(f"  STREAM read (a buffer of 4x the last-level cache or more) over the run: "
                 f"{min(steady_bandwidths):.1f}-{max(steady_bandwidths):.1f} GB/s")
    kv = {dtype: kv_capacity(config.model, dtype, config.kv_budget, config.kv_sequence_len)
          for dtype in config.kv_dtypes}
    if kv:
        lines += ["", f"KV cache ({config.kv_budget / 2**30:g} GiB budget, {config.kv_sequence_len}-token sequences):"]
    base = next(iter(kv.values()), None)
    for dtype, figures in kv.items():
        lines.append(f"  {dtype:<9} {figures['bytes_per_token']:6d} B/token  "
                     f"{figures['tokens_per_gib']:8d} tokens/GiB "
                     f"({figures['tokens_per_gib'] / base['tokens_per_gib']:.2f}x {config.kv_dtypes[0]})  "
                     f"{figures['sequences']:4d} concurrent sequences")
    report: dict[str, Any] = {"config": asdict(config), "rounds": rounds, "weights": summary, "kv": kv}
    if config.quality_model:
        quality = kv_quality(config.quality_model)
        report["kv_quality"] = quality
        lines += ["", f"KV cache dtypes on {config.quality_model} (greedy 48 tokens from {len(QUALITY_PROMPTS)} "
                      "prompts; prompt logprobs of the float32 continuations):"]
        for dtype, figures in quality.items():
            lines.append(f"  {dtype:<9} greedy equal {figures['greedy_equal']}/{figures['prompts']}, "
                         f"{figures['tokens_before_first_difference']}/{48 * figures['prompts']} tokens before "
                         f"the first difference; |logprob error| mean {figures['logprob_error_mean']:.2e}, "
                         f"max {figures['logprob_error_max']:.2e}")
    print("\n".join(lines))
    report["printed"] = lines
    if config.out:
        Path(config.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":  # the child process of run_child
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        spec = json.loads(sys.argv[2])
        Path(sys.argv[3]).write_text(json.dumps(measure_format(**spec), indent=1))
    else:
        sys.exit("usage: python bench/quant_decode.py (this module's own entry point is internal)")
