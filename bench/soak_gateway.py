"""Soak: mixed good and bad traffic through the gateway to two real `kvik serve` replicas of a tiny
model, with one replica killed (SIGKILL, then restarted) and the other stopped (SIGSTOP, later
SIGCONT) in the middle of the run.

    .venv/bin/python bench/soak_gateway.py [--duration 600] [--concurrency 6] [--json OUT]

The traffic: good chat, streamed chat (with the usage chunk), completions and repeated greedy
requests (cache hits) on one key; malformed, ill-typed, oversized, over-long and poison requests on
another; streams the client drops after two events; and a key with a tight TPM limit.

Checks (the exit status is 1 when one fails):
- no request hung: every one ended within the client's bound (`--hang-bound`);
- no accepted request lost: every 200 is whole (a non-streaming answer with a finish reason and
  usage; a stream with a finish reason, the usage chunk and `[DONE]`), and every failure is explicit
  (an OpenAI error body, or a stream that ends with an error event and no `[DONE]`);
- memory bounded: the gateway's and the surviving replica's RSS at the end are within
  `max(1.5 x, +256 MiB)` and `max(2 x, +512 MiB)` of their RSS after warm-up;
- usage rows equal the tokens delivered: for the good key, the rows of finished requests sum to the
  usage the client received, the rows of failed streams to the content events the client received,
  and there is one row per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
KVIK = [sys.executable, "-m", "kvik.cli.main"]
ADMIN_KEY = "kvik-soak-admin"
MODEL = "tiny"
MIB = 1024 * 1024


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Process:
    """A server subprocess on 127.0.0.1 with its output in a log file."""

    def __init__(self, name: str, argv: list[str], port: int, logs: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.port = name, argv, port
        self.log = logs / f"{name}.log"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=self.env)

    def ready(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                sys.exit(f"{self.name} exited:\n{self.log.read_text(errors='replace')[-3000:]}")
            if self.ready():
                return
            time.sleep(0.2)
        sys.exit(f"{self.name} was not ready in {timeout} s:\n{self.log.read_text(errors='replace')[-3000:]}")

    def signal(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.signal(signal.SIGCONT)  # a stopped process cannot handle SIGTERM
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def rss(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None
        try:
            return psutil.Process(self.proc.pid).memory_info().rss
        except psutil.Error:
            return None


@dataclass(slots=True)
class Result:
    kind: str
    verdict: str  # ok | error (explicit) | dropped (by the client, on purpose) | hung | lost
    status: int | None
    latency_s: float
    cached: bool = False
    prompt_tokens: int = 0  # the usage the client received (finished requests)
    completion_tokens: int = 0
    content_events: int = 0  # content deltas received in a stream
    detail: str = ""


@dataclass
class Run:
    args: argparse.Namespace
    gateway: Process
    replicas: list[Process]
    keys: dict[str, dict[str, Any]]
    results: list[Result] = field(default_factory=list)
    rss: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    events: list[tuple[float, str]] = field(default_factory=list)
    started: float = 0.0  # monotonic
    started_wall: float = 0.0  # unix seconds, for the usage query


def words(rng: random.Random, low: int, high: int) -> str:
    vocabulary = ["gateway", "replica", "token", "stream", "cache", "tenant", "budget", "model", "the", "a"]
    return " ".join(rng.choice(vocabulary) for _ in range(rng.randint(low, high)))


def bad_request(rng: random.Random) -> tuple[str, bytes]:
    """(path, raw body) of a request the gateway or the replica must refuse."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        ("/v1/chat/completions", b'{"model": "tiny", "messages": ['),
        ("/v1/chat/completions", json.dumps({**chat, "stream": True, "stream_options": "x"}).encode()),
        ("/v1/chat/completions", json.dumps({**chat, "model": "gpt-9"}).encode()),
        ("/v1/chat/completions", json.dumps({**chat, "max_tokens": "many"}).encode()),
        ("/v1/chat/completions", json.dumps({**chat, "messages": [{"role": "user", "content": "word " * 700}]})
         .encode()),
        ("/v1/chat/completions", json.dumps({**chat, "max_tokens": 100_000}).encode()),
        ("/v1/chat/completions", json.dumps({**chat, "logit_bias": {"\u00b2": 1}}).encode()),
        ("/v1/chat/completions", json.dumps({**chat, "temperature": -1}).encode()),
        ("/v1/chat/completions", (json.dumps(chat)[:-1] + ', "metadata": ' + "[" * 5000 + "]" * 5000 + "}").encode()),
        ("/v1/chat/completions", json.dumps({**chat, "messages": [{"role": "user", "content": "x" * (2 * MIB)}]})
         .encode()),
        ("/v1/completions", json.dumps({"model": MODEL, "prompt": [1, 99_999_999], "max_tokens": 2}).encode()),
    ]
    return rng.choice(cases)


def sse_data(text: str) -> list[str]:
    # SSE lines end only at CR, LF or CRLF. str.splitlines() also splits at U+0085, U+2028 and the
    # like, which JSON may carry raw inside a string (a random model's tokens do): that broke an
    # event in two and counted a whole answer as lost.
    return [line[len("data: "):] for line in re.split(r"\r\n|\r|\n", text) if line.startswith("data: ")]


def judge_json(kind: str, response: httpx.Response, latency: float) -> Result:
    try:
        body = response.json()
    except ValueError:
        return Result(kind, "lost", response.status_code, latency, detail=response.text[:200])
    if response.status_code != 200:
        explicit = isinstance(body, dict) and isinstance(body.get("error"), dict) and body["error"].get("message")
        return Result(kind, "error" if explicit else "lost", response.status_code, latency, detail=response.text[:200])
    choice = (body.get("choices") or [{}])[0]
    usage = body.get("usage") or {}
    text = choice.get("message", {}).get("content") if "message" in choice else choice.get("text")
    whole = isinstance(text, str) and choice.get("finish_reason") in ("length", "stop") and "completion_tokens" in usage
    return Result(kind, "ok" if whole else "lost", 200, latency, cached=response.headers.get("x-kvik-cache") == "hit",
                  prompt_tokens=usage.get("prompt_tokens", 0), completion_tokens=usage.get("completion_tokens", 0),
                  detail="" if whole else response.text[:300])


def judge_stream(kind: str, status: int, text: str, latency: float, cached: bool) -> Result:
    events = sse_data(text)
    try:
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
    except ValueError:
        return Result(kind, "lost", status, latency, detail=f"not JSON: {text[-300:]}")
    content = sum(1 for c in chunks for ch in c.get("choices") or [] if (ch.get("delta") or {}).get("content"))
    if events and events[-1] == "[DONE]":
        usage = next((c["usage"] for c in chunks if c.get("usage")), None)
        finished = any(ch.get("finish_reason") for c in chunks for ch in c.get("choices") or [])
        errors = any("error" in c for c in chunks)
        whole = usage is not None and finished and not errors
        return Result(kind, "ok" if whole else "lost", status, latency, cached=cached,
                      prompt_tokens=(usage or {}).get("prompt_tokens", 0),
                      completion_tokens=(usage or {}).get("completion_tokens", 0), content_events=content,
                      detail="" if whole else text[-300:])
    if chunks and "error" in chunks[-1]:
        return Result(kind, "error", status, latency, content_events=content, detail=json.dumps(chunks[-1])[:200])
    return Result(kind, "lost", status, latency, content_events=content, detail=text[-300:])


async def one_request(run: Run, client: httpx.AsyncClient, rng: random.Random) -> Result:
    """One request of a random kind, judged; `hung` when it takes longer than the bound in all."""
    started = time.monotonic()
    try:
        async with asyncio.timeout(run.args.hang_bound):
            return await _one_request(run, client, rng)
    except TimeoutError:
        return Result("?", "hung", None, time.monotonic() - started)


async def _one_request(run: Run, client: httpx.AsyncClient, rng: random.Random) -> Result:
    kind = rng.choices(["chat", "stream", "completion", "greedy", "bad", "drop", "limited"],
                       weights=[30, 30, 5, 8, 12, 7, 8])[0]
    key = run.keys[_key_of(kind)]
    headers = {"Authorization": f"Bearer {key['key']}"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": words(rng, 3, 30)}],
            "max_tokens": rng.randint(4, 24)}
    started = time.monotonic()
    try:
        if kind in ("chat", "limited", "greedy"):
            if kind == "greedy":
                chat = {**chat, "messages": [{"role": "user", "content": f"repeat {rng.randint(0, 4)}"}],
                        "max_tokens": 8, "temperature": 0}
            response = await client.post("/v1/chat/completions", json=chat, headers=headers)
            return judge_json(kind, response, time.monotonic() - started)
        if kind == "completion":
            body = {"model": MODEL, "prompt": words(rng, 3, 20), "max_tokens": rng.randint(4, 16)}
            response = await client.post("/v1/completions", json=body, headers=headers)
            return judge_json(kind, response, time.monotonic() - started)
        if kind == "bad":
            path, raw = bad_request(rng)
            response = await client.post(path, content=raw, headers={**headers, "content-type": "application/json"})
            result = judge_json(kind, response, time.monotonic() - started)
            return result if result.verdict != "ok" else Result(kind, "lost", 200, result.latency_s,
                                                                 detail="a bad request succeeded")
        body = {**chat, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                return judge_json(kind, response, time.monotonic() - started)
            if kind == "drop":
                seen = 0
                async for line in response.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 2:
                        break
                return Result(kind, "dropped", 200, time.monotonic() - started)
            text = "".join([part async for part in response.aiter_text()])
        return judge_stream(kind, 200, text, time.monotonic() - started,
                            response.headers.get("x-kvik-cache") == "hit")
    except httpx.TimeoutException:
        return Result(kind, "hung", None, time.monotonic() - started)
    except httpx.HTTPError as exc:
        return Result(kind, "lost", None, time.monotonic() - started, detail=repr(exc))


async def traffic(run: Run, deadline: float) -> None:
    limits = httpx.Limits(max_connections=run.args.concurrency * 2)
    async with httpx.AsyncClient(base_url=run.gateway.url, timeout=run.args.hang_bound, limits=limits) as client:
        async def worker(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < deadline:
                run.results.append(await one_request(run, client, rng))

        await asyncio.gather(*(worker(seed) for seed in range(run.args.concurrency)))


def faults(run: Run, stop_event: threading.Event) -> None:
    """Kill replica 1 at 25 % of the run and restart it at 35 %; stop replica 2 at 55 % (or when
    replica 1 is back, if later, up to 65 %) and continue it after 15 % of the run (at most 60 s)."""
    duration = run.args.duration
    first, second = run.replicas

    def at(fraction: float) -> bool:
        return not stop_event.wait(max(0.0, run.started + duration * fraction - time.monotonic()))

    def note(what: str) -> None:
        run.events.append((round(time.monotonic() - run.started, 1), what))
        print(f"  [{time.monotonic() - run.started:6.1f} s] {what}", flush=True)

    if not at(0.25):
        return
    first.signal(signal.SIGKILL)
    assert first.proc is not None
    first.proc.wait()
    note(f"SIGKILL {first.name}")
    if not at(0.35):
        return
    first.launch()
    note(f"restarting {first.name}")
    if not at(0.55):
        return
    latest = run.started + duration * 0.65
    while not first.ready() and time.monotonic() < latest and not stop_event.is_set():
        time.sleep(0.5)
    note(f"{first.name} ready: {first.ready()}")
    second.signal(signal.SIGSTOP)
    note(f"SIGSTOP {second.name}")
    stop_event.wait(min(60.0, duration * 0.15))
    second.signal(signal.SIGCONT)
    note(f"SIGCONT {second.name}")


def sample_rss(run: Run, stop_event: threading.Event) -> None:
    while not stop_event.wait(1.0):
        now = time.monotonic() - run.started
        for process in (run.gateway, *run.replicas):
            rss = process.rss()
            if rss is not None:
                run.rss.setdefault(process.name, []).append((now, rss))


def start(args: argparse.Namespace, tmp: Path) -> Run:
    model_dir = tmp / "model"
    subprocess.run([*KVIK, "make-model", str(model_dir), "--arch", "llama", "--size", "tiny"], check=True,
                   cwd=REPO, capture_output=True)
    replica_env = {"OMP_NUM_THREADS": "1", "KVIK_CPU_KERNELS": "0"}
    replicas = []
    for name in ("replica-1", "replica-2"):
        port = free_port()
        replicas.append(Process(name, [*KVIK, "serve", "--model", str(model_dir), "--port", str(port),
                                       "--served-model-name", MODEL, "--max-model-len", "512"],
                                port, tmp, replica_env))
    for replica in replicas:
        replica.launch()
    for replica in replicas:
        replica.wait_ready(args.ready_timeout)
    config = {
        "models": [{"name": MODEL, "replicas": [{"url": r.url} for r in replicas]}],
        "auth": {"admin_key": "env:KVIK_SOAK_ADMIN_KEY"},
        "database_url": f"sqlite:///{tmp / 'soak.db'}",
        "health": {"interval_s": 0.5, "timeout_s": 1.0, "unhealthy_after": 2},
        "breaker": {"sleep_window_s": 3.0},
        "timeouts": {"first_byte_s": 8.0, "read_s": 8.0},  # the stop outlasts them: streams on it break
        "guardrails": {"pii": {"enabled": True}},
        "limits": {"max_body_bytes": MIB},
    }
    (tmp / "gateway.yaml").write_text(yaml.safe_dump(config))
    port = free_port()
    gateway = Process("gateway", [*KVIK, "gateway", "--config", str(tmp / "gateway.yaml"), "--port", str(port)],
                      port, tmp, {"KVIK_SOAK_ADMIN_KEY": ADMIN_KEY})
    gateway.launch()
    gateway.wait_ready(120)
    keys = {}
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30) as admin:
        for name, spec in {"good": {}, "bad": {}, "drop": {}, "limited": {"tpm": 400}}.items():
            response = admin.post("/admin/keys", json={"name": name, **spec})
            response.raise_for_status()
            keys[name] = response.json()
        # Warm up: first-use costs are paid before the clock starts.
        good = {"Authorization": f"Bearer {keys['good']['key']}"}
        for _ in range(4):
            admin.post("/v1/chat/completions", headers=good, json={
                "model": MODEL, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 4})
    return Run(args, gateway, replicas, keys)


def check(run: Run) -> dict[str, Any]:
    results = run.results
    verdicts = Counter(r.verdict for r in results)
    failures: list[str] = []
    if verdicts["hung"]:
        failures.append(f"{verdicts['hung']} request(s) hung past {run.args.hang_bound} s")
    lost = [r for r in results if r.verdict == "lost"]
    if lost:
        examples = "; ".join(f"{r.kind} {r.status} {r.detail}" for r in lost[:5])
        failures.append(f"{len(lost)} request(s) lost: {examples}")

    memory: dict[str, Any] = {}
    bounds = {"gateway": (1.5, 256 * MIB), run.replicas[1].name: (2.0, 512 * MIB)}
    for name, samples in run.rss.items():
        warm = [rss for t, rss in samples if t >= min(5.0, run.args.duration * 0.05)] or [s[1] for s in samples]
        memory[name] = {"after_warm_up_mib": round(warm[0] / MIB, 1), "max_mib": round(max(warm) / MIB, 1),
                        "end_mib": round(warm[-1] / MIB, 1)}
        if name in bounds:
            factor, slack = bounds[name]
            limit = max(warm[0] * factor, warm[0] + slack)
            memory[name]["bound_mib"] = round(limit / MIB, 1)
            if warm[-1] > limit:
                failures.append(f"{name} RSS grew from {warm[0] / MIB:.0f} to {warm[-1] / MIB:.0f} MiB")

    good = [r for r in results if _key_of(r.kind) == "good"]
    delivered_prompt = sum(r.prompt_tokens for r in good if r.verdict == "ok" and not r.cached)
    delivered_completion = sum(r.completion_tokens for r in good if r.verdict == "ok" and not r.cached)
    failed_stream_events = sum(r.content_events for r in good if r.verdict == "error" and r.status == 200)
    time.sleep(1.0)  # a stream's row is written just after its last byte went out
    with httpx.Client(base_url=run.gateway.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30) as admin:
        rows = admin.get("/admin/usage", params={"key_id": run.keys["good"]["id"], "group_by": "key,status",
                                                 "since": run.started_wall}).json()["data"]
    finished = [row for row in rows if row["status"] == 200]
    charged_prompt = sum(row["prompt_tokens"] for row in finished)
    charged_completion = sum(row["completion_tokens"] for row in finished)
    failed_completion = sum(row["completion_tokens"] for row in rows if row["status"] != 200)
    row_count = sum(row["requests"] for row in rows)
    accounting = {"requests": len(good), "rows": row_count,
                  "delivered": [delivered_prompt, delivered_completion],
                  "charged": [charged_prompt, charged_completion],
                  "failed_stream_events": failed_stream_events, "failed_rows_completion": failed_completion}
    if (charged_prompt, charged_completion) != (delivered_prompt, delivered_completion):
        failures.append(f"usage rows of finished requests {charged_prompt}+{charged_completion} != tokens "
                        f"delivered {delivered_prompt}+{delivered_completion}")
    if failed_completion != failed_stream_events:
        failures.append(f"usage rows of failed requests charge {failed_completion} completion tokens, the "
                        f"client received {failed_stream_events}")
    if row_count != len(good):
        failures.append(f"{len(good)} requests on the good key, {row_count} usage rows")

    latencies = sorted(r.latency_s for r in results)
    return {
        "duration_s": run.args.duration, "requests": len(results), "verdicts": dict(verdicts),
        "statuses": dict(Counter(str(r.status) for r in results)),
        "kinds": dict(Counter(r.kind for r in results)),
        "latency_s": {"p50": round(latencies[len(latencies) // 2], 3),
                      "p99": round(latencies[int(len(latencies) * 0.99)], 3),
                      "max": round(latencies[-1], 3)} if latencies else {},
        "events": run.events, "memory": memory, "accounting": accounting, "failures": failures,
        "sample_errors": [asdict(r) for r in results if r.verdict == "error"][:5],
    }


def _key_of(kind: str) -> str:
    return {"bad": "bad", "drop": "drop", "limited": "limited"}.get(kind, "good")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default 600)")
    parser.add_argument("--concurrency", type=int, default=6, help="clients sending at once")
    parser.add_argument("--hang-bound", type=float, default=90.0,
                        help="seconds after which a request counts as hung (the client's timeout)")
    parser.add_argument("--ready-timeout", type=float, default=300.0, help="seconds a replica may take to start")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvik-soak-") as tmp_name:
        tmp = Path(tmp_name)
        print(f"starting two kvik serve replicas and a gateway (logs in {tmp})", flush=True)
        run = start(args, tmp)
        stop_event = threading.Event()
        try:
            run.started, run.started_wall = time.monotonic(), time.time()
            threads = [threading.Thread(target=faults, args=(run, stop_event), daemon=True),
                       threading.Thread(target=sample_rss, args=(run, stop_event), daemon=True)]
            for thread in threads:
                thread.start()
            print(f"{args.duration:.0f} s of traffic at concurrency {args.concurrency}", flush=True)
            asyncio.run(traffic(run, run.started + args.duration))
            stop_event.set()
            for thread in threads:
                thread.join(timeout=120)
            summary = check(run)
        finally:
            stop_event.set()
            for process in (run.gateway, *run.replicas):
                process.stop()
    print(json.dumps(summary, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))
    if summary["failures"]:
        print("FAILED:\n  " + "\n  ".join(summary["failures"]), file=sys.stderr)
        return 1
    print("soak passed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
