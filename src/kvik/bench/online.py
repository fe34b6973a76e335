"""Online and prefix comparisons through real HTTP servers on 127.0.0.1.

- online: the same Poisson workload (prompts of 64-256 random tokens, 64 output tokens) against
  `kvik serve` at each rate and against the naive server (HF `generate`, one request at a time) at
  the rates where it is to be compared; p99 TTFT and goodput (TTFT < 2 s, TPOT < 200 ms) side by side.
- prefix: a 1024-token shared system prompt with distinct 32-token questions, kvik with prefix caching
  on and off; TTFT p50 of each.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx

from kvik.bench.load import LoadConfig
from kvik.bench.serve_load import run_serve_benchmark, write_document
from kvik.bench.stats import SLO, format_table
from kvik.bench.workloads import WorkloadSpec

GOODPUT_SLO = SLO(ttft_ms=2000, tpot_ms=200)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_server(command: list[str], port: int, log_path: Path, timeout: float = 600) -> Iterator[str]:
    """Start a server process, wait for /health == 200, yield its base URL, then stop it."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{command[:4]} exited early; see {log_path}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready after {timeout}s; see {log_path}")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def kvik_command(model: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kvik.cli.main", "serve", "--model", model, "--port", str(port),
            "--served-model-name", "m", "--max-model-len", "2048", "--log-level", "warning", *extra]


def naive_command(model: str, port: int) -> list[str]:
    return [sys.executable, "-m", "kvik.bench.naive_server", "--model", model, "--port", str(port),
            "--served-model-name", "m"]


@dataclass(slots=True)
class OnlineConfig:
    model: str
    out_dir: Path
    kvik_rates: list[float] = field(default_factory=lambda: [0.25, 0.5, 1.0, 2.0, 4.0])
    naive_rates: list[float] = field(default_factory=lambda: [0.25, 0.5])
    num_prompts: int = 64
    kv_cache_memory: str = "2GiB"
    prefix_concurrency: int = 4


def _spec_for_rate(spec: WorkloadSpec, rate: float) -> WorkloadSpec:
    """The workload at one rate: its own seed, so one kvik server serving the whole sweep cannot
    answer later rates from prompts cached at earlier ones (the naive server has no cache)."""
    return WorkloadSpec(kind=spec.kind, num_prompts=spec.num_prompts, input_len_range=spec.input_len_range,
                        output_len_range=spec.output_len_range, prefix_len=spec.prefix_len,
                        question_len=spec.question_len, seed=int(rate * 1000))


def _run(url: str, spec: WorkloadSpec, label: str, rate: float, out: Path,
         concurrency: int | None = None) -> dict[str, Any]:
    config = LoadConfig(base_url=url, model="m", request_rate=rate, max_concurrency=concurrency,
                        seed=spec.seed)
    document = run_serve_benchmark(spec, config, GOODPUT_SLO, label=label)
    write_document(document, out)
    print(format_table(document["summary"], f"{label} | {spec.kind} | rate {rate:g}"), flush=True)
    return document


def run_online(config: OnlineConfig) -> dict[str, Any]:
    """Sweep kvik and the naive server over request rates; return {label: {rate: summary}}."""
    config.out_dir.mkdir(parents=True, exist_ok=True)
    spec = WorkloadSpec(kind="random", num_prompts=config.num_prompts, input_len_range=(64, 256),
                        output_len_range=(64, 64), seed=0)
    results: dict[str, dict[float, dict[str, Any]]] = {"kvik": {}, "naive": {}}
    port = free_port()
    with running_server(kvik_command(config.model, port, "--kv-cache-memory", config.kv_cache_memory),
                        port, config.out_dir / "kvik-server.log") as url:
        for rate in config.kvik_rates:
            doc = _run(url, _spec_for_rate(spec, rate), "kvik", rate,
                       config.out_dir / f"online-kvik-{rate:g}.json")
            results["kvik"][rate] = doc["summary"]
    port = free_port()
    with running_server(naive_command(config.model, port), port, config.out_dir / "naive-server.log") as url:
        for rate in config.naive_rates:
            doc = _run(url, _spec_for_rate(spec, rate), "naive", rate,
                       config.out_dir / f"online-naive-{rate:g}.json")
            results["naive"][rate] = doc["summary"]
    return results


def run_prefix(config: OnlineConfig) -> dict[str, dict[str, Any]]:
    """TTFT with prefix caching on and off on the shared-system-prompt workload."""
    spec = WorkloadSpec(kind="prefix", num_prompts=32, output_len_range=(16, 16), prefix_len=1024,
                        question_len=32, seed=0)
    results = {}
    for label, extra in (("prefix-cache-on", ()), ("prefix-cache-off", ("--no-prefix-caching",))):
        port = free_port()
        with running_server(kvik_command(config.model, port, "--kv-cache-memory", config.kv_cache_memory,
                                         *extra), port, config.out_dir / f"{label}.log") as url:
            doc = _run(url, spec, label, float("inf"), config.out_dir / f"{label}.json",
                       concurrency=config.prefix_concurrency)
            results[label] = doc["summary"]
    return results


def online_verdicts(results: dict[str, dict[float, dict[str, Any]]]) -> list[dict[str, Any]]:
    """For every rate where the naive server's p99 TTFT exceeds 10 s (and kvik ran too): kvik's p99
    TTFT and the goodput ratio. All of them, not the most flattering one."""
    verdicts = []
    for rate in sorted(r for r, s in results["naive"].items() if s["p99_ttft_ms"] > 10_000):
        kvik, naive = results["kvik"].get(rate), results["naive"][rate]
        if kvik is None:
            continue
        ratio = kvik["goodput"] / naive["goodput"] if naive["goodput"] else float("inf")
        verdicts.append({"rate": rate, "naive_p99_ttft_ms": naive["p99_ttft_ms"],
                         "kvik_p99_ttft_ms": kvik["p99_ttft_ms"], "kvik_goodput": kvik["goodput"],
                         "naive_goodput": naive["goodput"], "goodput_ratio": ratio})
    return verdicts


def summary_lines(online: dict[str, Any] | None, prefix: dict[str, Any] | None,
                  num_prompts: int = 64) -> list[str]:
    lines = []
    if online is not None:
        lines.append(f"\nonline (Poisson, {num_prompts} requests, prompts 64-256, 64 output tokens):")
        for label, by_rate in online.items():
            for rate, s in sorted(by_rate.items()):
                lines.append(f"  {label:<6} rate {rate:5g}/s  TTFT p50 {s['p50_ttft_ms']:9.0f} ms  p99 "
                             f"{s['p99_ttft_ms']:9.0f} ms  TPOT p50 {s['p50_tpot_ms']:6.0f} ms  goodput "
                             f"{s['goodput']:.3f} req/s")
        verdicts = online_verdicts(online)
        for v in verdicts:
            lines.append(f"  at {v['rate']:g} req/s the naive p99 TTFT is {v['naive_p99_ttft_ms'] / 1000:.1f} s; "
                         f"kvik's is {v['kvik_p99_ttft_ms'] / 1000:.2f} s (target < 2 s: "
                         f"{'meets' if v['kvik_p99_ttft_ms'] < 2000 else 'MISSES'}); goodput "
                         f"{v['goodput_ratio']:.1f}x the naive server's (target >= 5x: "
                         f"{'meets' if v['goodput_ratio'] >= 5 else 'MISSES'})")
        if not verdicts:
            lines.append("  the naive server never exceeded 10 s p99 TTFT at the rates tried")
    if prefix is not None:
        on, off = prefix["prefix-cache-on"], prefix["prefix-cache-off"]
        ratio = off["p50_ttft_ms"] / on["p50_ttft_ms"]
        lines.append(f"\nprefix workload (1024-token shared prompt, 32 questions): TTFT p50 "
                     f"{on['p50_ttft_ms']:.0f} ms cached vs {off['p50_ttft_ms']:.0f} ms uncached = "
                     f"{ratio:.1f}x (target >= 5x: {'meets' if ratio >= 5 else 'MISSES'})")
    return lines


def save(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, default=str))
