"""Priority tiers and fair share under saturation: `--scheduling-policy priority` against `fcfs`, in
one run, on real `kvik serve` processes (one per policy, same model and flags).

1. Tiers. Interactive requests (priority -10, streamed) arrive at a steady rate, first alone (their
   unloaded TTFT), then while a background tier (priority 10) offers more than the server can do and
   a Batch API job of `--batch-lines` lines runs. Reported: interactive p50/p99 TTFT loaded and
   unloaded and their ratio, then whether the background requests and the batch all finish once the
   offered load stops.
2. Fair share. Tenant A sends ten times tenant B's request rate; B alone asks for about 60 % of the
   capacity (measured first with a saturating closed loop). Reported: B's share of the tokens served
   and B's tokens served over B's tokens asked for.

The interactive probes run in this process; every other load runs in a child process of its own, so
that a load generator's own event-loop lag never counts as the server's.

    python bench/tenancy.py                       # the 125M reference model (random weights) kvik writes
    python bench/tenancy.py --model-size tiny     # a model so cheap that the API server is the bottleneck
    python bench/tenancy.py --model DIR --seconds 60
"""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import json
import multiprocessing
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path

import httpx

PRIORITY = {"interactive": -10, "background": 10}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, model: str, policy: str, workdir: Path, max_num_seqs: int,
                 max_num_batched_tokens: int | None = None, lower_tier_prefill_chunk: int | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / f"server-{policy}.log", "wb")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvik.cli.main", "serve", "--model", model, "--port", str(self.port),
             "--served-model-name", "m", "--max-model-len", "1024", "--max-num-seqs", str(max_num_seqs),
             "--max-waiting", "100000", "--scheduling-policy", policy, "--batch-db", str(workdir / f"{policy}.db"),
             *(["--max-num-batched-tokens", str(max_num_batched_tokens)] if max_num_batched_tokens else []),
             *(["--lower-tier-prefill-chunk", str(lower_tier_prefill_chunk)]
               if lower_tier_prefill_chunk is not None and policy == "priority" else [])],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"server ({policy}) exited; see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise SystemExit(f"server ({policy}) did not start")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


async def stream_ttft(client: httpx.AsyncClient, url: str, body: dict) -> float:
    """Seconds from sending to the first token of a streamed completion (read to the end)."""
    started, ttft = time.perf_counter(), None
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if ttft is None and line.startswith("data: ") and '"text"' in line:
                ttft = time.perf_counter() - started
    if ttft is None:
        raise RuntimeError("no token came back")
    return ttft


def unique(body: dict, tag: object) -> dict:
    """`body` with its prompt made this request's own. Real requests differ (a user's message, a
    document to summarise); identical prompts would all hit the prefix cache after the first, and
    every "prefill" would be one token."""
    return {**body, "prompt": f"{tag}: {body['prompt']}"}


def successes(results: list) -> list[float]:
    failures = [r for r in results if not isinstance(r, float)]
    if failures:
        print(f"  {len(failures)} interactive request(s) failed: {failures[0]!r}", file=sys.stderr)
    return [r for r in results if isinstance(r, float)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def periodic(rate: float, seconds: float, make) -> list:  # noqa: ANN001
    """Start make() every 1/rate seconds for `seconds`; gather the results."""
    tasks, started = [], time.perf_counter()
    position = 0.0
    while position < seconds:
        await asyncio.sleep(max(0.0, started + position - time.perf_counter()))
        tasks.append(asyncio.ensure_future(make()))
        position += 1 / rate
    return await asyncio.gather(*tasks, return_exceptions=True)


def offer_process(url: str, body: dict, rate: float, seconds: float, drain: bool, results) -> None:  # noqa: ANN001
    """Open-loop load in its own process: a POST every 1/rate s for `seconds`. A generator sharing the
    interactive probes' event loop adds its own lag (hundreds of requests a second) to every probe, and
    may not even manage to offer the rate. With `drain`, waits for every request to end; without, what
    is still running at the end of the window is cancelled (the client leaves). Puts (requests sent,
    requests that succeeded, completion tokens received within the window) on `results`."""

    async def run() -> tuple[int, int, int, dict[str, int]]:
        sent = served = ok = 0
        failures: dict[str, int] = {}
        end = time.perf_counter() + seconds

        async def one(client: httpx.AsyncClient) -> None:
            nonlocal sent, served, ok
            sent += 1
            try:
                response = await client.post(url, json=unique(body, f"{os.getpid()}.{sent}"))
            except httpx.HTTPError as exc:
                failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
                return
            if response.status_code != 200:
                failures[str(response.status_code)] = failures.get(str(response.status_code), 0) + 1
            else:
                ok += 1
                if time.perf_counter() <= end:
                    served += response.json()["usage"]["completion_tokens"]

        async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=None)) as client:
            work = asyncio.ensure_future(periodic(rate, seconds, lambda: one(client)))
            if not drain:
                await asyncio.sleep(seconds)
                for task in asyncio.all_tasks():
                    if task is not asyncio.current_task():
                        task.cancel()
            await asyncio.gather(work, return_exceptions=True)
        return sent, ok, served, failures

    results.put(asyncio.run(run()))


class Offered:
    """`offer_process` started now in a child process; `result()` waits for its numbers."""

    def __init__(self, url: str, body: dict, rate: float, seconds: float, drain: bool) -> None:
        context = multiprocessing.get_context("spawn")
        self.results = context.Queue()
        self.process = context.Process(target=offer_process, daemon=True,
                                       args=(url, body, rate, seconds, drain, self.results))
        self.process.start()

    async def result(self) -> tuple[int, int, int, dict[str, int]]:
        outcome = await asyncio.to_thread(self.results.get, True, 3600)
        self.process.join(60)
        return outcome


async def tiers(server: Server, args: argparse.Namespace, background_rate: float, batch_lines: int) -> dict:
    prompt = "hello " * 16
    interactive = {"model": "m", "prompt": "hello " * args.interactive_prompt_words, "max_tokens": 8, "ignore_eos": True,
                   "priority": PRIORITY["interactive"], "tenant": "chat"}
    background = {"model": "m", "prompt": prompt * 4, "max_tokens": args.max_tokens, "ignore_eos": True,
                  "priority": PRIORITY["background"], "tenant": "bulk"}
    numbers = itertools.count()

    def chat() -> Awaitable[float]:
        return stream_ttft(client, server.url, unique(interactive, f"chat {next(numbers)}"))

    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=None)) as client:
        # Warm-up, not measured: the first requests of each shape pay one-time costs (allocations,
        # the tokenizer's caches, the HTTP connections) that are no part of either TTFT.
        for i in range(3):
            await chat()
            await client.post(f"{server.url}/v1/completions", json=unique(background, f"warm-up {i}"))
        unloaded = successes(await periodic(args.interactive_rate, args.seconds / 2, chat))
        lines = [{"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
                  "body": unique({**background, "tenant": None, "priority": 0}, f"batch {i}")}
                 for i in range(batch_lines)]
        content = ("\n".join(json.dumps(line) for line in lines) + "\n").encode()
        uploaded = (await client.post(f"{server.url}/v1/files", data={"purpose": "batch"},
                                      files={"file": ("in.jsonl", io.BytesIO(content))})).json()
        batch = (await client.post(f"{server.url}/v1/batches", json={
            "input_file_id": uploaded["id"], "endpoint": "/v1/completions", "completion_window": "24h"})).json()
        offered = Offered(f"{server.url}/v1/completions", background, background_rate, args.seconds, drain=True)
        await asyncio.sleep(2.0)  # let the queue build (and the child start)
        loaded = successes(await periodic(args.interactive_rate, args.seconds - 2, chat))
        load_stopped = time.perf_counter()
        sent, finished, _, failures = await offered.result()
        if failures:
            print(f"  background requests that failed: {failures}", file=sys.stderr)
        drain_s = time.perf_counter() - load_stopped
        while True:
            state = (await client.get(f"{server.url}/v1/batches/{batch['id']}")).json()
            if state["status"] in ("completed", "failed", "expired", "cancelled"):
                break
            await asyncio.sleep(0.5)
        batch_drain_s = time.perf_counter() - load_stopped
    p99_unloaded, p99_loaded = percentile(unloaded, 0.99), percentile(loaded, 0.99)
    return {"unloaded_p50": statistics.median(unloaded), "unloaded_p99": p99_unloaded,
            "loaded_p50": statistics.median(loaded), "loaded_p99": p99_loaded, "ratio": p99_loaded / p99_unloaded,
            "interactive": len(loaded), "background": f"{finished}/{sent}", "drain_s": drain_s,
            "batch": f"{state['status']} {state['request_counts']['completed']}/{state['request_counts']['total']}",
            "batch_drain_s": batch_drain_s}


async def capacity(server: Server, max_tokens: int, seconds: float) -> float:
    """Completion tokens per second with a saturating closed loop."""
    body = {"model": "m", "prompt": "capacity probe", "max_tokens": max_tokens, "ignore_eos": True}
    tokens, end = 0, time.perf_counter() + seconds
    async with httpx.AsyncClient(timeout=3600) as client:
        async def loop() -> None:
            nonlocal tokens
            while time.perf_counter() < end:
                response = await client.post(f"{server.url}/v1/completions", json=body)
                tokens += response.json()["usage"]["completion_tokens"]

        started = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(32)))
    return tokens / (time.perf_counter() - started)


async def fairness(server: Server, args: argparse.Namespace, tokens_per_s: float) -> dict:
    rate_b = 0.6 * tokens_per_s / args.max_tokens
    body = {"model": "m", "max_tokens": args.max_tokens, "ignore_eos": True}
    url = f"{server.url}/v1/completions"
    loads = {tenant: Offered(url, {**body, "prompt": f"tenant {tenant}", "tenant": tenant}, rate, args.seconds,
                             drain=False)
             for tenant, rate in (("A", 10 * rate_b), ("B", rate_b))}
    outcome = {tenant: await load.result() for tenant, load in loads.items()}
    served = {tenant: tokens for tenant, (_, _, tokens, _) in outcome.items()}
    asked_b = outcome["B"][0] * args.max_tokens
    total = served["A"] + served["B"]
    return {"b_share": served["B"] / total if total else 0.0, "b_served_over_asked": served["B"] / max(1, asked_b),
            "rate_b": rate_b, "tokens": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="model directory (default: a random model kvik writes, of --model-size)")
    parser.add_argument("--model-size", default="bench", choices=("tiny", "small", "bench"),
                        help="bench (default): the 125M reference model, where the engine is the bottleneck, "
                             "as with any real model; tiny: a model so cheap that the API server is")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each measured phase")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the servers' per-step token budget (a smaller one bounds how long a step holding "
                             "background prefill makes an arriving interactive request wait)")
    parser.add_argument("--lower-tier-prefill-chunk", type=int, default=None,
                        help="the priority server's --lower-tier-prefill-chunk (default: the server's, 16 "
                             "on a CPU; 0: off)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per background/fairness request")
    parser.add_argument("--interactive-rate", type=float, default=4.0, help="interactive requests per second")
    parser.add_argument("--interactive-prompt-words", type=int, default=16,
                        help="words in an interactive prompt (a chat with a system prompt and history has hundreds)")
    parser.add_argument("--background-rate", type=float, default=None,
                        help="background requests per second (default: --overload times the measured capacity)")
    parser.add_argument("--overload", type=float, default=2.0,
                        help="background load offered in the tiers phase, as a multiple of the capacity")
    parser.add_argument("--batch-lines", type=int, default=None,
                        help="lines of the Batch API job (default: the capacity of one phase, so that it "
                             "runs all through the loaded phase)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kvik-bench-tenancy-"))
    model = args.model
    if model is None:
        model = str(workdir / args.model_size)
        subprocess.run([sys.executable, "-m", "kvik.cli.main", "make-model", model, "--arch", "llama",
                        "--size", args.model_size], check=True, capture_output=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report = {}
    for policy in ("fcfs", "priority"):
        server = Server(model, policy, workdir, args.max_num_seqs, args.max_num_batched_tokens,
                        args.lower_tier_prefill_chunk)
        try:
            # Capacity first: the background tier is sized from it, so the loaded phase really offers
            # more than the server can do on this machine, however fast it is.
            tokens_per_s = asyncio.run(capacity(server, args.max_tokens, min(10.0, args.seconds / 2)))
            background_rate = args.background_rate or args.overload * tokens_per_s / args.max_tokens
            batch_lines = args.batch_lines or max(10, int(tokens_per_s * args.seconds / args.max_tokens))
            report[policy] = asyncio.run(tiers(server, args, background_rate, batch_lines))
            report[policy]["background_rate"] = background_rate
            report[policy].update(asyncio.run(fairness(server, args, tokens_per_s)))
            report[policy]["capacity_tok_s"] = tokens_per_s
        finally:
            server.stop()
    rows = [("interactive TTFT p50 unloaded (s)", "unloaded_p50", "{:.3f}"),
            ("interactive TTFT p99 unloaded (s)", "unloaded_p99", "{:.3f}"),
            ("interactive TTFT p50 loaded (s)", "loaded_p50", "{:.3f}"),
            ("interactive TTFT p99 loaded (s)", "loaded_p99", "{:.3f}"),
            ("p99 loaded / unloaded", "ratio", "{:.2f}"),
            ("background requests offered per second", "background_rate", "{:.1f}"),
            ("background requests finished", "background", "{}"),
            ("  ... s after the load stopped", "drain_s", "{:.1f}"),
            ("batch job", "batch", "{}"),
            ("  ... s after the load stopped", "batch_drain_s", "{:.1f}"),
            ("capacity (completion tok/s)", "capacity_tok_s", "{:.0f}"),
            ("B share of tokens served (A at 10x B's rate)", "b_share", "{:.2f}"),
            ("B tokens served / B tokens asked", "b_served_over_asked", "{:.2f}")]
    print(f"{'':48} {'fcfs':>14} {'priority':>14}")
    for label, key, fmt in rows:
        print(f"{label:48} {fmt.format(report['fcfs'][key]):>14} {fmt.format(report['priority'][key]):>14}")
    print(f"\n(workdir {workdir}; model {model}; max_num_seqs {args.max_num_seqs}, "
          f"max_num_batched_tokens {args.max_num_batched_tokens or 'default'}, priority's lower_tier_prefill_chunk "
          f"{'default' if args.lower_tier_prefill_chunk is None else args.lower_tier_prefill_chunk}, "
          f"{args.seconds:.0f} s phases)")


if __name__ == "__main__":
    main()
