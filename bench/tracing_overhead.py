"""What OpenTelemetry tracing costs `kvik serve`: throughput with tracing off, on with sample ratio 0
(SDK loaded, spans created unsampled) and on with ratio 1 (every request's spans exported over
OTLP/HTTP), side by side, as paired ratios to "off".

    .venv/bin/python bench/tracing_overhead.py [--model DIR] [--rounds 4] [--requests 48]
                                              [--concurrency 8] [--max-tokens 32] [--json]

Three `kvik serve` processes of the same model run at once (idle ones cost nothing but memory); the
load visits them in turn (off, ratio 0, ratio 1, off, ...), so drift in the machine's speed hits all
three alike, and each round's ratio compares neighbours. Beside throughput it reports the CPU time
each server (API process and engine core) spent per request, read from the OS, which what else
runs on a shared machine moves much less. The traced servers export to a sink in this
process that accepts OTLP/HTTP and drops it (its CPU cost is this process's, not the server's). The
default model is the tiny random Llama (`kvik make-model`): the cheaper a token, the larger tracing's
share, so this is the worst case; pass a real model with --model for a realistic one. There is no
"tracing code absent" build to compare with: "off" is the shipped default, which takes one global
read per span site and imports no OpenTelemetry.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
KVIK = [sys.executable, "-m", "kvik.cli.main"]
MODES = ("off", "ratio0", "ratio1")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Sink(BaseHTTPRequestHandler):
    """Accepts OTLP/HTTP exports and drops them."""

    received = 0

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length", "0")))
        Sink.received += 1
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def start_server(model: str, mode: str, sink_url: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    argv = [*KVIK, "serve", "--model", model, "--port", str(port), "--served-model-name", "m",
            "--max-model-len", "512", "--log-level", "warning"]
    if mode != "off":
        argv += ["--otlp-traces-endpoint", sink_url, "--otlp-traces-sample-ratio", "0" if mode == "ratio0" else "1"]
    # One torch thread per server unless told otherwise: three servers share the machine's cores,
    # and spinning OpenMP threads of idle-waiting servers would swamp the figures.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=REPO, env=env)
    return proc, f"http://127.0.0.1:{port}"


def cpu_seconds(proc: subprocess.Popen[bytes]) -> float:
    """User + system CPU seconds of the server process and its children (the engine core) so far."""
    import psutil

    root = psutil.Process(proc.pid)
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"kvik serve exited:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    sys.exit(f"kvik serve did not start:\n{log.read_text()[-2000:]}")


async def load(url: str, requests: int, concurrency: int, max_tokens: int) -> dict[str, float]:
    """Stream `requests` chat completions, `concurrency` at a time; tokens/s and requests/s."""
    limit = asyncio.Semaphore(concurrency)
    body = {"model": "m", "messages": [{"role": "user", "content": "Tell me about tracing overhead."}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    tokens = 0
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one() -> None:
            nonlocal tokens
            async with limit:
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    assert response.status_code == 200, await response.aread()
                    async for line in response.aiter_lines():
                        if line.startswith("data: {") and '"usage":{' in line.replace(" ", ""):
                            usage = json.loads(line[6:]).get("usage")
                            if usage:
                                tokens += usage["completion_tokens"]

        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(requests)))
        elapsed = time.perf_counter() - started
    return {"tokens_per_s": tokens / elapsed, "requests_per_s": requests / elapsed, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: a tiny random Llama)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=48, help="requests per mode per round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="kvik-tracing-bench-"))
    model = args.model
    if model is None:
        from kvik.model.make_model import make_model

        model = str(make_model(workdir / "tiny-llama", "llama", "tiny"))
    sink = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    sink_url = f"http://127.0.0.1:{sink.server_address[1]}/v1/traces"

    servers = {mode: start_server(model, mode, sink_url, workdir / f"{mode}.log") for mode in MODES}
    try:
        for mode, (proc, url) in servers.items():
            wait_ready(proc, url, workdir / f"{mode}.log")
            asyncio.run(load(url, args.concurrency, args.concurrency, args.max_tokens))  # warm-up
        rounds: list[dict[str, dict[str, float]]] = []
        for index in range(args.rounds):
            # Rotate the order each round, so no mode always runs first (or right after another).
            order = MODES[index % 3:] + MODES[:index % 3]
            result = {}
            for mode in order:
                proc, url = servers[mode]
                cpu_before = cpu_seconds(proc)
                result[mode] = asyncio.run(load(url, args.requests, args.concurrency, args.max_tokens))
                result[mode]["cpu_ms_per_request"] = (cpu_seconds(proc) - cpu_before) * 1000 / args.requests
            rounds.append(result)
            if not args.json:
                print(f"round {index + 1}: " + "  ".join(
                    f"{mode} {result[mode]['tokens_per_s']:.0f} tok/s {result[mode]['cpu_ms_per_request']:.0f} cpu-ms/req"
                    for mode in MODES), flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        sink.shutdown()

    summary = {
        "model": args.model or "tiny random llama", "rounds": args.rounds, "requests": args.requests,
        "concurrency": args.concurrency, "max_tokens": args.max_tokens, "cpus": os.cpu_count(),
        "otlp_exports_received": Sink.received,
        "tokens_per_s_median": {m: statistics.median(r[m]["tokens_per_s"] for r in rounds) for m in MODES},
        "ratio_to_off_median": {m: statistics.median(r[m]["tokens_per_s"] / r["off"]["tokens_per_s"] for r in rounds)
                                for m in MODES[1:]},
        "ratio_to_off_per_round": {m: [round(r[m]["tokens_per_s"] / r["off"]["tokens_per_s"], 4) for r in rounds]
                                   for m in MODES[1:]},
        # CPU time the server (API process + engine core) spent per request: less sensitive than
        # throughput to what else runs on the machine.
        "server_cpu_ms_per_request_median": {m: statistics.median(r[m]["cpu_ms_per_request"] for r in rounds)
                                             for m in MODES},
        "cpu_ratio_to_off_median": {m: statistics.median(r[m]["cpu_ms_per_request"] / r["off"]["cpu_ms_per_request"]
                                                         for r in rounds) for m in MODES[1:]},
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"median tokens/s: " + ", ".join(f"{m} {v:.0f}" for m, v in summary["tokens_per_s_median"].items()))
    for mode in MODES[1:]:
        print(f"{mode} / off: median {summary['ratio_to_off_median'][mode]:.3f} "
              f"(per round {summary['ratio_to_off_per_round'][mode]})")
    print("server CPU ms per request (median): " + ", ".join(
        f"{m} {v:.1f}" for m, v in summary["server_cpu_ms_per_request_median"].items()))
    for mode in MODES[1:]:
        print(f"{mode} / off server CPU per request: median {summary['cpu_ratio_to_off_median'][mode]:.3f}")
    print(f"OTLP exports received: {Sink.received}")


if __name__ == "__main__":
    main()
