"""What the gateway adds per request: latency (p50, p99) and throughput, side by side with calling
the upstream directly. The upstream answers at once (the test fake, not recording bodies), so every
millisecond above the direct figures is the gateway's.

    .venv/bin/python bench/gateway_overhead.py [--requests 500] [--concurrency 16] [--json]

Three set-ups against the same upstream process:
  direct        client -> upstream
  gateway       client -> gateway (auth off, cache off, no guardrails) -> upstream
  gateway+keys  client -> gateway (key auth, RPM/TPM limits, PII redaction, usage rows) -> upstream

All processes share this machine's cores with the client, so latency and throughput depend on what
else runs; the CPU time the gateway process itself spends per request (read from /proc during the
throughput run) does not, and is the steadiest measure of its cost.
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
import time
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
FAKE_UPSTREAM = REPO / "tests" / "gateway" / "fake_upstream.py"
ADMIN_KEY = "kvik-bench-admin"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "How fast is the gateway?"}], "max_tokens": 8}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(argv: list[str], port: int, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{argv} exited:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    sys.exit(f"{argv} did not start:\n{log.read_text()[-2000:]}")


def start_gateway(tmp: Path, name: str, upstream_url: str,
                  full: bool) -> tuple[subprocess.Popen[bytes], str, str | None]:
    config = {
        "models": [{"name": "tiny", "replicas": [{"url": upstream_url}]}],
        "auth": {"enabled": full, "admin_key": "env:KVIK_BENCH_ADMIN_KEY"},
        "database_url": f"sqlite:///{tmp / (name + '.db')}",
        "cache": {"enabled": False},
        "guardrails": {"pii": {"enabled": full}},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    proc = start([sys.executable, "-m", "kvik.cli.main", "gateway", "--config", str(path), "--port", str(port)],
                 port, tmp / f"{name}.log", env={"KVIK_BENCH_ADMIN_KEY": ADMIN_KEY})
    url = f"http://127.0.0.1:{port}"
    key = None
    if full:
        response = httpx.post(url + "/admin/keys", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                              json={"name": "bench", "rpm": 10_000_000, "tpm": 10_000_000_000})
        key = response.json()["key"]
    return proc, url, key


def measure_latency(url: str, key: str | None, n: int) -> list[float]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        for _ in range(min(50, n)):  # warm up connections, caches, code paths
            client.post("/v1/chat/completions", json=BODY).raise_for_status()
        latencies = []
        for _ in range(n):
            started = time.perf_counter()
            client.post("/v1/chat/completions", json=BODY).raise_for_status()
            latencies.append(time.perf_counter() - started)
    return latencies


async def measure_throughput(url: str, key: str | None, n: int, concurrency: int) -> float:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60, limits=limits) as client:
        remaining = n

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                (await client.post("/v1/chat/completions", json=BODY)).raise_for_status()

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return n / (time.perf_counter() - started)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far (Linux /proc), or None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500, help="sequential requests for latency")
    parser.add_argument("--throughput-requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()

    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="kvik-bench-gw-") as tmp_name:
        tmp = Path(tmp_name)
        try:
            port = free_port()
            procs.append(start([sys.executable, str(FAKE_UPSTREAM), "--port", str(port), "--no-record"],
                               port, tmp / "upstream.log"))
            upstream = f"http://127.0.0.1:{port}"
            upstream_pid = procs[0].pid
            targets: list[tuple[str, str, str | None, int | None]] = [("direct", upstream, None, None)]
            for name, full in (("gateway", False), ("gateway+keys", True)):
                proc, url, key = start_gateway(tmp, name, upstream, full)
                procs.append(proc)
                targets.append((name, url, key, proc.pid))
            results = []
            for name, url, key, gateway_pid in targets:
                latencies = measure_latency(url, key, args.requests)
                cpu_before = {pid: cpu_seconds(pid) for pid in (upstream_pid, gateway_pid) if pid}
                rps = asyncio.run(measure_throughput(url, key, args.throughput_requests, args.concurrency))
                cpu_ms = {pid: _per_request_ms(before, cpu_seconds(pid), args.throughput_requests)
                          for pid, before in cpu_before.items()}
                results.append({"setup": name, "p50_ms": statistics.median(latencies) * 1000,
                                "p99_ms": percentile(latencies, 0.99) * 1000, "throughput_rps": rps,
                                "gateway_cpu_ms_per_request": cpu_ms.get(gateway_pid) if gateway_pid else None,
                                "upstream_cpu_ms_per_request": cpu_ms[upstream_pid]})
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=10)

    direct = results[0]
    for row in results:
        row["added_p50_ms"] = row["p50_ms"] - direct["p50_ms"]
        row["added_p99_ms"] = row["p99_ms"] - direct["p99_ms"]
    if args.json:
        print(json.dumps({"requests": args.requests, "concurrency": args.concurrency, "cpus": os.cpu_count(),
                          "results": results}, indent=2))
        return
    print(f"{args.requests} sequential requests for latency; {args.throughput_requests} at concurrency "
          f"{args.concurrency} for throughput; {os.cpu_count()} CPUs shared by client, gateway and upstream\n")
    print(f"{'setup':14} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} {'added p99':>10} {'req/s':>8} "
          f"{'gateway CPU ms/req':>19} {'upstream CPU ms/req':>20}")
    for row in results:
        print(f"{row['setup']:14} {row['p50_ms']:8.2f} {row['p99_ms']:8.2f} {row['added_p50_ms']:10.2f} "
              f"{row['added_p99_ms']:10.2f} {row['throughput_rps']:8.0f} "
              f"{_fmt(row['gateway_cpu_ms_per_request']):>19} {_fmt(row['upstream_cpu_ms_per_request']):>20}")


def _per_request_ms(before: float | None, after: float | None, requests: int) -> float | None:
    if before is None or after is None:
        return None
    return (after - before) * 1000 / requests


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
