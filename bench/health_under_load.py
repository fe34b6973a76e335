#!/usr/bin/env python
"""How fast /health answers while the engine is saturated, against the same probe when idle.

    python bench/health_under_load.py [--model DIR] [--concurrency 64] [--max-tokens 200]

Starts `kvik serve` on 127.0.0.1 (the small demo-sized model by default), probes /health every 50 ms
idle and then while `--concurrency` streaming requests keep the engine busy, and prints latency
percentiles for both. The engine runs on its own thread, so the probe should stay in the tens of
milliseconds even when every step is full.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def probe(url: str, seconds: float) -> list[float]:
    latencies = []
    async with httpx.AsyncClient(timeout=10) as client:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            started = time.perf_counter()
            response = await client.get(url)
            latencies.append(time.perf_counter() - started)
            assert response.status_code == 200, response.status_code
            await asyncio.sleep(0.05)
    return latencies


async def load(base: str, concurrency: int, max_tokens: int, stop: asyncio.Event) -> int:
    body = {"model": "m", "prompt": "Tell me a story", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    done = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done
        while not stop.is_set():
            async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
                async for _ in response.aiter_lines():
                    pass
            done += 1

    async with httpx.AsyncClient(timeout=300) as client:
        tasks = [asyncio.create_task(worker(client)) for _ in range(concurrency)]
        await stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return done


def summary(name: str, values: list[float]) -> str:
    ms = sorted(v * 1000 for v in values)
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    return (f"{name:<12} n={len(ms):4d}  p50 {statistics.median(ms):7.1f} ms  p99 {p99:7.1f} ms  "
            f"max {ms[-1]:7.1f} ms")


async def measure(base: str, concurrency: int, max_tokens: int, seconds: float) -> None:
    idle = await probe(f"{base}/health", seconds)
    stop = asyncio.Event()
    load_task = asyncio.create_task(load(base, concurrency, max_tokens, stop))
    await asyncio.sleep(2)  # let the batch fill
    busy = await probe(f"{base}/health", seconds)
    metrics = httpx.get(f"{base}/metrics").text
    running = [line for line in metrics.splitlines() if line.startswith("kvik:num_requests_running")]
    stop.set()
    await load_task
    print(summary("idle", idle))
    print(summary("saturated", busy))
    print(f"ratio p50 saturated/idle: {statistics.median(busy) / statistics.median(idle):.1f}x; "
          f"while saturated: {running[0] if running else '?'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: a small random Llama)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from kvik.model.make_model import make_model

        model = str(make_model(Path(tempfile.mkdtemp()) / "small", "llama", "small"))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "kvik.cli.main", "serve", "--model", model,
                               "--port", str(port), "--served-model-name", "m", "--max-model-len", "1024",
                               "--log-level", "warning"])
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        asyncio.run(measure(base, args.concurrency, args.max_tokens, args.seconds))
    finally:
        server.terminate()
        server.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
