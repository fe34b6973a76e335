"""`kvik bench compare`: kvik against the baselines a user would otherwise run, in one invocation.

Every system runs on the same random-weight reference model and the same prompts, each in its own
child process (one process tree), and the figures are printed as ratios:

- offline: kvik vs HF sequential `generate` and HF static batching (left-padded batches of 16),
  useful tokens per second, and kvik's achieved FLOP/s as a fraction of the matmul roofline;
- single-stream decode: weight bytes per token times tokens per second, over the read bandwidth
  measured in reads paired with its steps;
- memory: kvik's peak RSS while generating against weights + configured KV budget (on CUDA its
  peak allocated device memory instead);
- online and prefix workloads through real HTTP servers (see `kvik.bench.online`);
- with `llamacpp_dir`, a llama.cpp column: both engines on the same GGUF files, per precision pair
  (see `kvik.bench.llamacpp`).

`device` and `dtype` (cpu/float32 by default on a machine without a GPU) put the offline systems and
the single-stream decode on one device in one dtype: kvik and HF on the same card, the roofline
measured on it. The online and prefix parts start their servers as they always have (`kvik serve`
on its default device, the naive server on the CPU in float32).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvik.bench.offline import random_workload, resolve_device_dtype, synchronize
from kvik.bench.online import OnlineConfig, run_online, run_prefix, save, summary_lines
from kvik.bench.roofline import DTYPES, ModelShape, Roofline, dtype_bytes, measure_roofline, stream_reader
from kvik.model.huge_pages import huge_page_empty


@dataclass(slots=True)
class CompareConfig:
    model: str
    num_requests: int = 64
    input_len_range: tuple[int, int] = (64, 512)
    output_len_range: tuple[int, int] = (16, 256)
    seed: int = 0
    kv_cache_memory: int = 3 * 2**30
    systems: tuple[str, ...] = ("kvik", "hf-static", "hf-sequential")
    engine_args: dict[str, Any] = field(default_factory=dict)
    run_offline: bool = True
    run_online: bool = True
    run_prefix: bool = True
    out_dir: str = "bench-results"
    kvik_rates: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0)
    naive_rates: tuple[float, ...] = (0.25, 0.5)
    # The llama.cpp column, only when llamacpp_dir is set: label -> HF directory or .gguf file.
    llamacpp_dir: str | None = None
    llamacpp_models: dict[str, str] = field(default_factory=dict)
    llamacpp_pairs: list[dict[str, Any]] = field(default_factory=list)
    llamacpp_rounds: int = 1
    # Where the offline systems and the decode run, and the dtype of their weights: auto as kvik's
    # engine picks (cuda if torch sees one, bfloat16 there, else cpu and float32); run_compare
    # replaces auto with the explicit names before any child starts.
    device: str = "auto"
    dtype: str = "auto"


def run_system(config: CompareConfig, system: str, workdir: Path) -> dict[str, Any]:
    """One system on the offline workload, in a child process; returns its JSON result."""
    out = workdir / f"offline-{system}.json"
    engine_args = {"kv_cache_memory": config.kv_cache_memory, **config.engine_args}
    command = [sys.executable, "-m", "kvik.bench.offline", "--system", system, "--model", config.model,
               "--num-requests", str(config.num_requests),
               "--input-len-range", ",".join(map(str, config.input_len_range)),
               "--output-len-range", ",".join(map(str, config.output_len_range)),
               "--seed", str(config.seed), "--engine-args", json.dumps(engine_args),
               "--device", config.device, "--dtype", config.dtype, "--json", str(out)]
    print(f"\n== offline: {system}", flush=True)
    subprocess.run(command, check=True)
    return json.loads(out.read_text())


def offline_flops(config: CompareConfig, shape: ModelShape) -> float:
    """FLOPs of the useful work: every prompt token and every output token (the last output token
    is sampled but never fed back, so it costs its LM-head row only)."""
    workload = random_workload(config.num_requests, config.input_len_range, config.output_len_range,
                               config.seed, shape.vocab)
    total = 0.0
    for prompt, max_tokens in zip(workload.prompts, workload.max_tokens):
        fed = len(prompt) + max_tokens - 1  # positions that run through the body
        total += shape.flops(list(range(fed)), logits_rows=max_tokens)
    return total


def single_stream_decode(model: str, bytes_per_token: int, prompt_len: int = 64, tokens: int = 256,
                         windows: int = 8, device: str = "cpu", dtype: str = "float32") -> dict[str, Any]:
    """Decode speed of one request alone, as a fraction of the read bandwidth measured alongside it.

    This machine's memory bandwidth changes from second to second (a shared host: the same buffer
    reads at 31-62 GB/s within a minute), so a bandwidth figure taken before the run is no ceiling
    for the decode after it. Instead every decode step is paired with a read of the same number of
    bytes from a buffer of that size (kvik's read kernel, `roofline.stream_reader`), right after it:
    the fraction is the total read time over the total decode time, with both sides of every pair
    seeing the same machine within milliseconds. The reads also evict the caches between steps,
    which only costs the decode. On CUDA the same pairing holds, with the read from device memory
    and both sides timed between synchronizes."""
    from kvik import LLM, SamplingParams

    llm = LLM(model, show_progress=False, kv_cache_memory=2**30, device=device, dtype=dtype)
    # A warm-up as long as the measured request: on CUDA each decode shape (block-table width) is
    # recorded as a graph on first use, ~0.1 s each on a 1.1B model, which would land in the timed
    # steps (windows alternating 9 % and 19 % on an H200 before this warm-up).
    llm.generate([[5] * prompt_len], SamplingParams(max_tokens=tokens, ignore_eos=True))
    engine = llm.engine
    bytes_per_token -= screened_head_discount(engine.core)
    decode_times, read_times = paired_decode_steps(engine, prompt_len, tokens, bytes_per_token,
                                                   device=device, dtype=dtype)
    size = tokens // windows
    window_fractions = [sum(read_times[i:i + size]) / sum(decode_times[i:i + size])
                        for i in range(0, size * windows, size)]
    return {"decode_tokens_per_second": tokens / sum(decode_times),
            "bytes_per_token": bytes_per_token,  # what a step reads (less than the model's with a screened head)
            "read_bandwidth": bytes_per_token * tokens / sum(read_times),
            "decode_bandwidth_fraction": sum(read_times) / sum(decode_times),
            "window_tokens": size, "window_fractions": window_fractions}


def screened_head_discount(core: Any) -> int:
    """Bytes per token a greedy single stream does not read from the LM head: runs of S forwards
    read its int8 copy in all but the first (kvik.model.transforms.screened_head). Taken off the
    bytes a step is paired with, so the fraction is of what the steps read (the few exact blocks
    they also read are left out, which only lowers it)."""
    from kvik.model.transforms.screened_head import greedy_bytes_saved

    head = getattr(core.model, "lm_head", None)
    if head is None:
        return 0
    steps = core.args.scheduler_steps()
    return int((steps - 1) / steps * greedy_bytes_saved(head))


def paired_decode_steps(engine: Any, prompt_len: int, tokens: int, bytes_per_token: int,
                        device: str = "cpu", dtype: str = "float32", burst: int = 1,
                        min_read_bytes: int = 0) -> tuple[list[float], list[float]]:
    """Decode `tokens` tokens of one greedy request on `engine` (an LLMEngine on `device`), with as
    many reads of `bytes_per_token` bytes on the same device; returns the seconds of every token
    and of every read. A step that is a run of forwards (multi-step decoding) counts as its tokens,
    each its share of the step's time.

    Steps for `burst` tokens run back to back, then `burst` reads, and so on. With 1 every step starts on the
    caches the read before it emptied, which a decode never meets outside this benchmark; with a
    few (8: ~20-40 ms a side on CPU) each step runs in its steady state, as tg128 decodes, where
    part of one pass over the same bytes can still be in the last-level cache at the next (on a
    32 MiB L3 a 69 MB int4 step took 2.5 ms alone against 2.8-3.3 ms right after a read), while
    both sides still see the same phase of a machine whose bandwidth moves from second to second.

    `min_read_bytes`: read a buffer of at least this size and count each read's time pro rata for
    `bytes_per_token` bytes. With 4x the last-level cache this is STREAM's rule for a memory
    bandwidth, a read that no cache serves; a buffer of the step's own size, read over and over,
    stays partly in the cache (on the 32 MiB L3: 69 MB at 36-37 GB/s, 128 MB at 32, 256 MB at 31)."""
    if burst < 1:
        raise ValueError(f"burst must be at least 1, got {burst}")
    from kvik import SamplingParams

    buffer_bytes = max(bytes_per_token, min_read_bytes)

    if device.startswith("cuda"):
        # In the weights' dtype, as the decode reads them; the reader synchronizes after the sum.
        buffer = torch.ones(buffer_bytes // dtype_bytes(dtype), device=device, dtype=DTYPES[dtype])
    else:
        # float32 whatever the weights' dtype: the CPU read kernel reads any buffer as 32-bit words
        # (it needs a multiple of 4 bytes), so the dtype changes nothing but that rounding. On huge
        # pages where the system has them, as the engine's weights are (kvik.model.huge_pages): on
        # 4 KiB pages the read is slower (30-43 against 34-72 GB/s here), and the bound too easy.
        buffer = huge_page_empty(buffer_bytes // 4 * 4).view(torch.float32).fill_(1.0)
    read = stream_reader(buffer)
    read()  # page it in
    share = bytes_per_token / buffer_bytes
    engine.add_request(f"solo-{burst}", list(range(3, 3 + prompt_len)),
                       SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True))
    engine.step()  # the prefill and the first token
    decode_times: list[float] = []
    read_times: list[float] = []
    core = engine.core
    while len(decode_times) < tokens:
        made = 0
        while made < burst and len(decode_times) < tokens:
            before = core.generation_tokens_total
            synchronize(device)  # nothing queued from before (the read synchronized already)
            started = time.perf_counter()
            engine.step()
            synchronize(device)  # the step's kernels done, in case any outlive its token's copy to the host
            elapsed = time.perf_counter() - started
            # A step is a run of several forwards under multi-step decoding: its time is shared
            # by its tokens, each of which gets its read.
            count = core.generation_tokens_total - before
            if count < 1:
                raise RuntimeError("a decode step produced no token: the request ended early")
            decode_times.extend([elapsed / count] * count)
            made += count
        for _ in range(made):
            started = time.perf_counter()
            read()
            read_times.append((time.perf_counter() - started) * share)
    del decode_times[tokens:], read_times[tokens:]  # max_tokens ends the last run on the count
    while engine.has_unfinished_requests():
        engine.step()
    return decode_times, read_times


def run_decode(model: str, bytes_per_token: int, workdir: Path, device: str = "cpu",
               dtype: str = "float32") -> dict[str, Any]:
    """single_stream_decode in a child process of its own, as each offline system gets. A process
    that has already allocated and freed large buffers (this one, for the roofline) decodes
    measurably slower: 84-87 % of the paired bandwidth against 93-95 % fresh, in four runs each."""
    out = workdir / "decode.json"
    print("\n== single-stream decode", flush=True)
    subprocess.run([sys.executable, "-m", "kvik.bench.compare", "--decode-child", model, str(bytes_per_token),
                    str(out), device, dtype], check=True)
    return json.loads(out.read_text())


def ratio_line(name: str, value: float, target: float, unit: str = "x") -> str:
    verdict = "meets" if value >= target else "MISSES"
    return f"  {name:<58} {value:8.2f}{unit}   target >= {target:g}{unit}: {verdict}"


def placement(config: CompareConfig) -> str:
    """' (cuda, bfloat16)' naming the device and dtype in the printed section titles; '' for the
    CPU in float32, whose lines read as they always have."""
    return "" if (config.device, config.dtype) == ("cpu", "float32") else f" ({config.device}, {config.dtype})"


def run_compare(config: CompareConfig) -> dict[str, Any]:
    # Explicit names before anything starts: every child gets the same device and dtype.
    config.device, config.dtype = resolve_device_dtype(config.device, config.dtype)
    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shape = ModelShape.from_model_dir(config.model, config.dtype)
    print(f"measuring this machine's roofline{placement(config)} ...", flush=True)
    roofline: Roofline = measure_roofline(config.device, config.dtype)
    report: dict[str, Any] = {"config": asdict(config), "device": config.device, "dtype": config.dtype,
                              "roofline": roofline.to_dict()}
    lines = ["\n" + roofline.describe()]
    summary: dict[str, float] = {}
    if config.run_offline:
        # Each system's JSON lands in the output directory as soon as it finishes.
        results = {system: run_system(config, system, out_dir) for system in config.systems}
        report["offline"] = results
        lines += offline_lines(config, shape, roofline, results, summary)
        report["decode"] = run_decode(config.model, shape.decode_bytes_per_token(), out_dir,
                                      config.device, config.dtype)
        decode = report["decode"]["decode_tokens_per_second"]
        achieved_bw = decode * report["decode"]["bytes_per_token"]
        summary["decode_bandwidth_fraction"] = report["decode"]["decode_bandwidth_fraction"]
        low, high = min(report["decode"]["window_fractions"]), max(report["decode"]["window_fractions"])
        lines.append(f"\nsingle-stream decode{placement(config)}: {decode:.1f} tok/s = "
                     f"{achieved_bw / 1e9:.1f} GB/s of weights; "
                     f"reads paired with its steps: {report['decode']['read_bandwidth'] / 1e9:.1f} GB/s "
                     f"({report['decode']['window_tokens']}-token windows: {100 * low:.0f}-{100 * high:.0f} %)")
        lines.append(ratio_line("decode bandwidth / paired read bandwidth",
                                100 * summary["decode_bandwidth_fraction"], 80, "%"))
    online_config = OnlineConfig(config.model, out_dir, list(config.kvik_rates), list(config.naive_rates),
                                 num_prompts=config.num_requests)
    online = prefix = None
    if config.run_online:
        print("\n== online", flush=True)
        online = run_online(online_config)
        report["online"] = {label: {str(r): s for r, s in by_rate.items()} for label, by_rate in online.items()}
        from kvik.bench.plot import plot_results

        plot = plot_results(sorted(out_dir.glob("online-*.json")), out_dir / "online.png")
        lines.append(f"\nlatency-vs-load plot: {plot}")
    if config.run_prefix:
        print("\n== prefix", flush=True)
        prefix = run_prefix(online_config)
        report["prefix"] = prefix
    lines += summary_lines(online, prefix, config.num_requests)
    if config.llamacpp_dir:
        from kvik.bench.llamacpp.harness import HarnessConfig, run_harness

        print("\n== llama.cpp", flush=True)
        llamacpp = run_harness(HarnessConfig(
            llamacpp_dir=Path(config.llamacpp_dir), out_dir=out_dir / "llamacpp",
            models={label: Path(path) for label, path in config.llamacpp_models.items()},
            pairs=config.llamacpp_pairs, rounds=config.llamacpp_rounds))
        report["llamacpp"] = llamacpp["results"]
        lines += ["\nkvik vs llama.cpp on the same GGUF files:"] + llamacpp["printed"]
    report["summary"] = summary
    print("\n".join(lines))
    report["printed"] = lines
    save(out_dir / "compare.json", report)
    return report


def offline_lines(config: CompareConfig, shape: ModelShape, roofline: Roofline,
                  results: dict[str, dict[str, Any]], summary: dict[str, float]) -> list[str]:
    lines = [f"\noffline{placement(config)} (useful prompt+output tokens per second; output tokens alone after):"]
    for system, result in results.items():
        line = (f"  {system:<16} {result['useful_tokens_per_second']:9.1f} tok/s   "
                f"{result['output_tokens_per_second']:7.1f} output tok/s   "
                f"{result['seconds']:7.1f} s   peak RSS {result['peak_rss_bytes'] / 2**30:.2f} GiB")
        if result.get("peak_device_bytes") is not None:
            line += f", device {result['peak_device_bytes'] / 2**30:.2f} GiB"
        lines.append(line)
    kvik = results.get("kvik")
    baselines = [r["useful_tokens_per_second"] for s, r in results.items() if s != "kvik"]
    if kvik and baselines:
        summary["offline_speedup_vs_best_hf"] = kvik["useful_tokens_per_second"] / max(baselines)
        lines.append(ratio_line("kvik / best HF baseline", summary["offline_speedup_vs_best_hf"], 2))
    if kvik:
        achieved = offline_flops(config, shape) / kvik["seconds"]
        summary["offline_roofline_fraction"] = achieved / roofline.matmul_flops
        rate = f"{achieved / 1e12:.1f} T" if roofline.device == "cuda" else f"{achieved / 1e9:.1f} G"
        lines.append(ratio_line(f"kvik FLOP/s ({rate}) / matmul roofline",
                                100 * summary["offline_roofline_fraction"], 60, "%"))
        budget = kvik["extra"]["weight_bytes"] + config.kv_cache_memory
        if kvik.get("peak_device_bytes") is not None:
            # On a GPU the weights and the KV cache live in device memory; the host's RSS holds
            # neither, so the device's allocator peak is the figure to hold against them.
            summary["memory_ratio"] = kvik["peak_device_bytes"] / budget
            name = "peak device memory while generating / (weights + KV budget)"
            lines.append(f"  {name:<61}{summary['memory_ratio']:6.2f}    target <= 1.25: "
                         f"{'meets' if summary['memory_ratio'] <= 1.25 else 'MISSES'}")
        else:
            summary["memory_ratio"] = kvik["peak_rss_bytes"] / budget
            lines.append(f"  peak RSS while generating / (weights + KV budget)"
                         f"{summary['memory_ratio']:14.2f}    target <= 1.25: "
                         f"{'meets' if summary['memory_ratio'] <= 1.25 else 'MISSES'}")
    return lines


if __name__ == "__main__":  # the child process of run_decode
    if len(sys.argv) == 7 and sys.argv[1] == "--decode-child":
        _, _, child_model, child_bytes, child_out, child_device, child_dtype = sys.argv
        Path(child_out).write_text(json.dumps(single_stream_decode(
            child_model, int(child_bytes), device=child_device, dtype=child_dtype), indent=1))
    else:
        sys.exit("usage: kvik bench compare (this module's own entry point is internal)")
