#!/usr/bin/env python
"""How fast /health and a 2-token request answer while the engine is saturated, and while a 5 MB
prompt is being tokenized: the engine in the server's process (as kvik was before the engine got
its own process) against the engine in its own process, in one run.

    python bench/health_under_load.py [--concurrency 64] [--max-tokens 200] [--seconds 10]

For each layout it starts `kvik serve` on 127.0.0.1 with the tiny random Llama whose context is
stretched to 4M tokens (so a 5 MB prompt is really tokenized rather than refused by its size) and
measures, each phase for `--seconds`:
- idle: /health every 50 ms, and a 2-token completion every 250 ms;
- saturated: the same while `--concurrency` streams keep every engine step full;
- tokenizing: the same while a client keeps sending a 5 MB chat message (each is tokenized, then
  refused for its length).
The load runs in a separate client process, so the probes measure the server, not the load
generator's own event loop. "before" is `--engine-in-thread --tokenizer-workers 0`: the engine loop on a thread of the API
server and tokenization on its event loop, the layout kvik had. "after" is the default: the engine
core in its own process, large inputs tokenized in worker processes. Target: /health p99 < 20 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

LONG_CONTEXT = 2**22


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def long_context_model(root: Path) -> Path:
    from kvik.model.make_model import make_model

    path = make_model(root / "tiny", "llama", "tiny")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = LONG_CONTEXT
    (path / "config.json").write_text(json.dumps(config))
    return path


async def probe_health(client: httpx.AsyncClient, base: str, stop: asyncio.Event) -> list[float]:
    latencies = []
    while not stop.is_set():
        started = time.perf_counter()
        response = await client.get(f"{base}/health")
        latencies.append(time.perf_counter() - started)
        assert response.status_code == 200, response.status_code
        await asyncio.sleep(0.05)
    return latencies


async def probe_short_request(client: httpx.AsyncClient, base: str, stop: asyncio.Event) -> list[float]:
    body = {"model": "m", "prompt": "Hi", "max_tokens": 2, "ignore_eos": True}
    latencies = []
    while not stop.is_set():
        started = time.perf_counter()
        response = await client.post(f"{base}/v1/completions", json=body)
        latencies.append(time.perf_counter() - started)
        assert response.status_code == 200, response.text
        await asyncio.sleep(0.25)
    return latencies


async def saturate(client: httpx.AsyncClient, base: str, concurrency: int, max_tokens: int,
                   stop: asyncio.Event) -> None:
    body = {"model": "m", "prompt": "Tell me a story", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}

    async def worker() -> None:
        while not stop.is_set():
            async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
                async for _ in response.aiter_lines():
                    if stop.is_set():
                        return

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def big_prompts(client: httpx.AsyncClient, base: str, stop: asyncio.Event) -> list[int]:
    words = "the quick brown fox jumps over the lazy dog and keeps on running " * 80_000  # ~5 MB
    body = {"model": "m", "messages": [{"role": "user", "content": words}],
            "max_tokens": LONG_CONTEXT}
    statuses = []
    while not stop.is_set():
        response = await client.post(f"{base}/v1/chat/completions", json=body, timeout=300)
        statuses.append(response.status_code)
    return statuses


def load_process(kind: str, base: str, concurrency: int, max_tokens: int, stop, results) -> None:
    """The background load, in its own process: a load generator sharing the probes' event loop
    would add its own loop lag (64 SSE parsers, json-encoding 5 MB bodies) to every probe."""

    async def run() -> object:
        loop_stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                await asyncio.sleep(0.05)
            loop_stop.set()

        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=200)) as client:
            watcher = asyncio.create_task(watch())
            if kind == "saturate":
                outcome = await saturate(client, base, concurrency, max_tokens, loop_stop)
            else:
                outcome = await big_prompts(client, base, loop_stop)
            await watcher
            return outcome

    results.put(asyncio.run(run()))


async def phase(base: str, seconds: float, kind: str | None,
                args: argparse.Namespace) -> tuple[list[float], list[float], object]:
    context = multiprocessing.get_context("spawn")
    stop, results = context.Event(), context.Queue()
    load = None
    if kind is not None:
        load = context.Process(target=load_process, daemon=True,
                               args=(kind, base, args.concurrency, args.max_tokens, stop, results))
        load.start()
        await asyncio.sleep(3)  # let the load build up (and the child start)
    probe_stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=300) as client:
        probes = asyncio.gather(probe_health(client, base, probe_stop),
                                probe_short_request(client, base, probe_stop))
        await asyncio.sleep(seconds)
        probe_stop.set()
        health, short = await probes
    extra = None
    if load is not None:
        stop.set()
        extra = await asyncio.to_thread(results.get, True, 600)
        load.join(60)
    return health, short, extra


def percentiles(values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values)
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 1),
            "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 1), "max_ms": round(ms[-1], 1)}


async def measure(base: str, args: argparse.Namespace) -> dict[str, dict]:
    results = {}
    phases = {"idle": None, "saturated": "saturate", "tokenizing 5 MB": "big_prompts"}
    for name, kind in phases.items():
        health, short, extra = await phase(base, args.seconds, kind, args)
        results[name] = {"health": percentiles(health), "2-token request": percentiles(short)}
        if name == "tokenizing 5 MB":
            results[name]["big prompt statuses"] = sorted(set(extra or []))
    return results


def run_layout(model: Path, extra: list[str], args: argparse.Namespace) -> dict[str, dict]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "kvik.cli.main", "serve", "--model", str(model),
                               "--port", str(port), "--served-model-name", "m", "--log-level", "warning",
                               "--kv-cache-memory", "2200MiB", "--max-body-bytes", str(64 * 2**20), *extra])
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise RuntimeError(f"server exited with {server.returncode}")
            time.sleep(0.5)
        return asyncio.run(measure(base, args))
    finally:
        server.terminate()
        server.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--layout", choices=["both", "before", "after"], default="both",
                        help="measure both layouts (the comparison) or only one")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    model = long_context_model(Path(tempfile.mkdtemp(prefix="kvik-health-")))
    layouts = {"before (engine thread, tokenizing on the loop)": ["--engine-in-thread", "--tokenizer-workers", "0"],
               "after (engine process, tokenizer workers)": []}
    if args.layout != "both":
        layouts = {name: extra for name, extra in layouts.items() if name.startswith(args.layout)}
    results = {name: run_layout(model, extra, args) for name, extra in layouts.items()}
    for layout, phases in results.items():
        print(f"\n{layout}")
        for name, figures in phases.items():
            h, s = figures["health"], figures["2-token request"]
            print(f"  {name:<16} /health p50 {h['p50_ms']:7.1f} ms  p99 {h['p99_ms']:7.1f} ms  max "
                  f"{h['max_ms']:7.1f} ms | 2-token request p50 {s['p50_ms']:7.1f} ms  p99 {s['p99_ms']:7.1f} ms"
                  + (f" | 5 MB prompt -> {figures['big prompt statuses']}" if "big prompt statuses" in figures else ""))
    if args.layout != "both":
        return 0
    before, after = results.values()
    for name in before:
        ratio = before[name]["health"]["p99_ms"] / max(after[name]["health"]["p99_ms"], 0.1)
        print(f"/health p99 {name}: before/after = {ratio:.1f}x; after meets < 20 ms: "
              f"{after[name]['health']['p99_ms'] < 20}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
