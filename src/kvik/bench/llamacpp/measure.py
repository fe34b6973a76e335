"""One workload on one engine. Every function returns plain figures (tokens/s, ms) for the harness.

llama.cpp: `llama-bench` for single-stream decode (tg128) and the 512-token prompt (pp512),
`llama-server --parallel 16` for the offline workload and the served latencies. kvik: its engine in a
child process for tg128/pp512/offline (`python -m kvik.bench.llamacpp.measure ...`), `kvik serve` for
the served latencies. Both servers get the same token-id requests from kvik's load generator, and run
side by side, each concurrency measured on one right after the other.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvik.bench.llamacpp.ggufs import llamacpp_bin
from kvik.bench.load import LoadConfig, run_load
from kvik.bench.offline import model_vocab_size, random_workload
from kvik.bench.online import free_port, kvik_command, running_server
from kvik.bench.stats import SLO, summarize
from kvik.bench.workloads import BenchRequest, WorkloadSpec, build_workload

PROMPT_TOKENS = 512  # pp512
DECODE_TOKENS = 128  # tg128
REPEATS = 3


@dataclass(frozen=True, slots=True)
class OfflineSpec:
    num_requests: int = 32
    input_len_range: tuple[int, int] = (64, 512)
    output_len_range: tuple[int, int] = (16, 128)
    seed: int = 0


@dataclass(frozen=True, slots=True)
class ServedSpec:
    concurrencies: tuple[int, ...] = (1, 4, 16)
    input_len_range: tuple[int, int] = (64, 512)
    output_len: int = 64
    min_prompts: int = 8  # per concurrency: max(min_prompts, 2 * concurrency)
    seed: int = 0


def engine_flags(engine_args: dict[str, Any]) -> list[str]:
    """kvik CLI flags for engine arguments: {"dtype": "bfloat16"} -> ["--dtype", "bfloat16"]."""
    flags: list[str] = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return flags


# --- llama.cpp -------------------------------------------------------------------------------------

def llamacpp_single_stream(llamacpp_dir: Path, gguf: Path, threads: int) -> dict[str, float]:
    """pp512 and tg128 tokens/s from one llama-bench run (the mean of REPEATS repetitions)."""
    command = [str(llamacpp_bin(llamacpp_dir, "llama-bench")), "-m", str(gguf), "-t", str(threads),
               "-p", str(PROMPT_TOKENS), "-n", str(DECODE_TOKENS), "-r", str(REPEATS), "-o", "json"]
    rows = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    prompt = next(r for r in rows if r["n_prompt"] == PROMPT_TOKENS and r["n_gen"] == 0)
    decode = next(r for r in rows if r["n_gen"] == DECODE_TOKENS and r["n_prompt"] == 0)
    return {"prompt_tokens_per_second": prompt["avg_ts"], "decode_tokens_per_second": decode["avg_ts"]}


def llamacpp_server_command(llamacpp_dir: Path, gguf: Path, port: int, threads: int,
                            parallel: int = 16, context_per_slot: int = 1024) -> list[str]:
    return [str(llamacpp_bin(llamacpp_dir, "llama-server")), "-m", str(gguf), "--host", "127.0.0.1",
            "--port", str(port), "-t", str(threads), "--parallel", str(parallel),
            "-c", str(parallel * context_per_slot), "--alias", "m"]


# --- both, over HTTP ----------------------------------------------------------------------------------

def offline_requests(spec: OfflineSpec, vocab: int) -> list[BenchRequest]:
    workload = random_workload(spec.num_requests, spec.input_len_range, spec.output_len_range,
                               spec.seed, vocab)
    return [BenchRequest(prompt=p, max_tokens=m, prompt_tokens=len(p))
            for p, m in zip(workload.prompts, workload.max_tokens)]


def http_offline(url: str, spec: OfflineSpec, vocab: int) -> dict[str, float]:
    """The offline workload sent all at once to a server: prompt + output tokens per second."""
    config = LoadConfig(base_url=url, model="m", show_progress=False)
    result = asyncio.run(run_load(offline_requests(spec, vocab), config))
    summary = summarize(result.records, result.duration_s, SLO())
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} offline request(s) failed on {url}")
    return {"tokens_per_second": summary["total_token_throughput"], "seconds": result.duration_s,
            "output_length_mismatches": summary["output_length_mismatches"]}


def served_at(url: str, spec: ServedSpec, vocab: int, concurrency: int) -> dict[str, float]:
    """TTFT and TPOT (p50, p99, ms) at one concurrency, closed loop."""
    workload = WorkloadSpec(kind="random", num_prompts=max(spec.min_prompts, 2 * concurrency),
                            input_len_range=spec.input_len_range,
                            output_len_range=(spec.output_len, spec.output_len),
                            seed=spec.seed + concurrency)
    config = LoadConfig(base_url=url, model="m", max_concurrency=concurrency, show_progress=False)
    result = asyncio.run(run_load(build_workload(workload, False, vocab), config))
    summary = summarize(result.records, result.duration_s, SLO())
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} request(s) failed at concurrency {concurrency} on {url}")
    return {key: summary[key] for key in (
        "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "output_throughput")}


def served_side_by_side(llamacpp_dir: Path, gguf: Path, threads: int, engine_args: dict[str, Any],
                        offline: OfflineSpec, served: ServedSpec, log_dir: Path,
                        llama_first: Callable[[int], bool]) -> tuple[dict[str, Any], dict[str, Any]]:
    """llama-server's offline workload, then both servers' latencies at each concurrency, measured
    back to back with both servers up (the idle one sleeps): (llama.cpp's figures, kvik's).

    `llama_first(i)` says which server goes first at the i-th concurrency. Pairing each concurrency's
    two runs seconds apart, rather than one server's three runs minutes before the other's, keeps a
    phase of the shared machine (its read speed moves 2x over minutes) out of the ratios.
    """
    vocab = model_vocab_size(str(gguf))
    llama_port, kvik_port = free_port(), free_port()
    llama_command = llamacpp_server_command(llamacpp_dir, gguf, llama_port, threads)
    kvik_serve = kvik_command(str(gguf), kvik_port, *engine_flags(engine_args))
    with running_server(llama_command, llama_port, log_dir / f"llama-server-{gguf.stem}.log") as llama_url, \
            running_server(kvik_serve, kvik_port, log_dir / f"kvik-serve-{gguf.stem}.log") as kvik_url:
        llama: dict[str, Any] = {"offline": http_offline(llama_url, offline, vocab), "served": {}}
        ours: dict[str, Any] = {"served": {}}
        runs = [(llama, llama_url), (ours, kvik_url)]
        for index, concurrency in enumerate(served.concurrencies):
            for side, url in runs if llama_first(index) else runs[::-1]:
                side["served"][str(concurrency)] = served_at(url, served, vocab, concurrency)
        return llama, ours


# --- kvik ----------------------------------------------------------------------------------------------

def kvik_engine(gguf: Path, engine_args: dict[str, Any], offline: OfflineSpec,
                out: Path) -> dict[str, Any]:
    """pp512, tg128 and the offline workload on kvik's engine, in a fresh child process."""
    subprocess.run([sys.executable, "-m", "kvik.bench.llamacpp.measure", str(gguf),
                    json.dumps(engine_args), json.dumps(asdict(offline)), str(out)], check=True)
    return json.loads(out.read_text())


def _kvik_child(gguf: str, engine_args: dict[str, Any], offline: dict[str, Any]) -> dict[str, Any]:
    import random

    from kvik import LLM, SamplingParams

    llm = LLM(gguf, show_progress=False, **engine_args)
    vocab = llm.engine.info.vocab_size
    rng = random.Random(0)
    llm.generate([[5] * 16], SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
    # Different prompts each repetition, so the prefix cache never serves one.
    prompt_rates, decode_rates = [], []
    for _ in range(REPEATS):
        prompt = [rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)]
        started = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
        prompt_rates.append(PROMPT_TOKENS / (time.perf_counter() - started))
    for _ in range(REPEATS):
        # tg128: 128 tokens from a one-token context, the first step included as llama-bench does.
        started = time.perf_counter()
        llm.generate([[rng.randrange(3, vocab)]],
                     SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True))
        decode_rates.append(DECODE_TOKENS / (time.perf_counter() - started))
    spec = OfflineSpec(offline["num_requests"], tuple(offline["input_len_range"]),
                       tuple(offline["output_len_range"]), offline["seed"])
    workload = random_workload(spec.num_requests, spec.input_len_range, spec.output_len_range,
                               spec.seed, vocab)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in workload.max_tokens]
    started = time.perf_counter()
    llm.generate(workload.prompts, params)
    seconds = time.perf_counter() - started
    return {"prompt_tokens_per_second": sum(prompt_rates) / REPEATS,
            "decode_tokens_per_second": sum(decode_rates) / REPEATS,
            "offline": {"tokens_per_second": (workload.prompt_tokens + workload.output_tokens) / seconds,
                        "seconds": seconds}}


if __name__ == "__main__":  # the child process of kvik_engine
    _, child_gguf, child_args, child_offline, child_out = sys.argv
    Path(child_out).write_text(json.dumps(
        _kvik_child(child_gguf, json.loads(child_args), json.loads(child_offline)), indent=1))
