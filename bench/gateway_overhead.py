"""What the gateway adds per request: latency (p50, p99) and throughput, side by side with calling
the upstream directly. The upstream answers at once (the test fake, not recording bodies), so every
millisecond above the direct figures is the gateway's.

    .venv/bin/python bench/gateway_overhead.py [--requests 500] [--concurrency 16] [--json]
        [--transport-rounds 2] [--transport-requests 100] [--transport-throughput-requests 200]

Three set-ups against the same upstream process:
  direct        client -> upstream
  gateway       client -> gateway (auth off, cache off, no guardrails) -> upstream
  gateway+keys  client -> gateway (key auth, RPM/TPM limits, PII redaction, usage rows) -> upstream

Then HTTP vs gRPC replicas (`kvik serve --grpc-port`, a tiny random model written for the run; skipped
without torch or grpcio, or with --transport-rounds 0): one kvik serve process, two gateways in front
of it, one with its http:// URL and one with its grpc:// URL, measured in alternating order (A B, then
B A) for non-streaming and streaming requests, with the replica called directly over HTTP and over
gRPC as the baselines. Printed as ratios gRPC / HTTP of the added latency and of the gateway's CPU
time per request (the steadiest figure: the replica's generation time is in the latencies of both).

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


def measure_latency(url: str, key: str | None, n: int, body: dict | None = None) -> list[float]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = body or BODY
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        for _ in range(min(50, n)):  # warm up connections, caches, code paths
            client.post("/v1/chat/completions", json=body).raise_for_status()
        latencies = []
        for _ in range(n):
            started = time.perf_counter()
            client.post("/v1/chat/completions", json=body).raise_for_status()  # reads a stream to its end
            latencies.append(time.perf_counter() - started)
    return latencies


async def measure_throughput(url: str, key: str | None, n: int, concurrency: int, body: dict | None = None) -> float:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60, limits=limits) as client:
        remaining = n

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                (await client.post("/v1/chat/completions", json=body or BODY)).raise_for_status()

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
    parser.add_argument("--transport-rounds", type=int, default=2,
                        help="paired rounds of the HTTP vs gRPC replica comparison (0: skip it)")
    parser.add_argument("--transport-requests", type=int, default=100,
                        help="sequential requests per set-up and round for latency (HTTP vs gRPC)")
    parser.add_argument("--transport-throughput-requests", type=int, default=200)
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

        transports = None
        if args.transport_rounds > 0:
            transports = compare_transports(tmp, rounds=args.transport_rounds, requests=args.transport_requests,
                                            throughput_requests=args.transport_throughput_requests,
                                            concurrency=args.concurrency)

    direct = results[0]
    for row in results:
        row["added_p50_ms"] = row["p50_ms"] - direct["p50_ms"]
        row["added_p99_ms"] = row["p99_ms"] - direct["p99_ms"]
    if args.json:
        print(json.dumps({"requests": args.requests, "concurrency": args.concurrency, "cpus": os.cpu_count(),
                          "results": results, "replica_transports": transports}, indent=2))
        return
    print(f"{args.requests} sequential requests for latency; {args.throughput_requests} at concurrency "
          f"{args.concurrency} for throughput; {os.cpu_count()} CPUs shared by client, gateway and upstream\n")
    print(f"{'setup':14} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} {'added p99':>10} {'req/s':>8} "
          f"{'gateway CPU ms/req':>19} {'upstream CPU ms/req':>20}")
    for row in results:
        print(f"{row['setup']:14} {row['p50_ms']:8.2f} {row['p99_ms']:8.2f} {row['added_p50_ms']:10.2f} "
              f"{row['added_p99_ms']:10.2f} {row['throughput_rps']:8.0f} "
              f"{_fmt(row['gateway_cpu_ms_per_request']):>19} {_fmt(row['upstream_cpu_ms_per_request']):>20}")
    if transports is not None:
        print_transports(transports)


def compare_transports(tmp: Path, *, rounds: int, requests: int, throughput_requests: int,
                       concurrency: int) -> dict | None:
    """Gateway overhead with an http:// vs a grpc:// replica (the same kvik serve process)."""
    try:
        import grpc
        import torch  # noqa: F401  (kvik serve's engine)

        from kvik.protocol.grpc import inference_pb2 as pb
        from kvik.protocol.grpc import inference_pb2_grpc as pb_grpc
    except ImportError as exc:
        print(f"HTTP vs gRPC replicas: skipped ({exc})", file=sys.stderr)
        return None
    kvik = [sys.executable, "-m", "kvik.cli.main"]
    model = tmp / "tiny-model"
    subprocess.run([*kvik, "make-model", str(model)], check=True, capture_output=True)
    port, grpc_port = free_port(), free_port()
    procs = [start([*kvik, "serve", "--model", str(model), "--served-model-name", "tiny", "--max-model-len", "512",
                    "--port", str(port), "--grpc-port", str(grpc_port)], port, tmp / "replica.log",
                   env={"OMP_NUM_THREADS": "1", "KVIK_CPU_KERNELS": "0"})]
    try:
        gateways = {}
        for transport, url in (("http", f"http://127.0.0.1:{port}"), ("grpc", f"grpc://127.0.0.1:{grpc_port}")):
            proc, gateway_url, _ = start_gateway(tmp, f"gateway-{transport}", url, False)
            procs.append(proc)
            gateways[transport] = (proc.pid, gateway_url)
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        stub = pb_grpc.InferenceStub(channel)
        grpc_request = pb.ChatRequest(model="tiny", messages=[pb.ChatMessage(role="user", text=BODY["messages"][0]["content"])],
                                      sampling=pb.SamplingParams(max_tokens=BODY["max_tokens"]))

        def direct_grpc(stream: bool, n: int) -> list[float]:
            call = (lambda: list(stub.ChatStream(grpc_request))) if stream else (lambda: stub.Chat(grpc_request))
            for _ in range(min(50, n)):
                call()
            latencies = []
            for _ in range(n):
                started = time.perf_counter()
                call()
                latencies.append(time.perf_counter() - started)
            return latencies

        samples: dict[tuple[str, bool], dict[str, list[float]]] = {}
        for round_index in range(rounds):
            order = ["http", "grpc"] if round_index % 2 == 0 else ["grpc", "http"]
            for stream in (False, True):
                body = {**BODY, "stream": stream}
                for transport in order:  # the replica alone, then through the gateway
                    direct = (measure_latency(f"http://127.0.0.1:{port}", None, requests, body) if transport == "http"
                              else direct_grpc(stream, requests))
                    pid, url = gateways[transport]
                    through = measure_latency(url, None, requests, body)
                    before = cpu_seconds(pid)
                    rps = asyncio.run(measure_throughput(url, None, throughput_requests, concurrency, body))
                    cpu = _per_request_ms(before, cpu_seconds(pid), throughput_requests)
                    row = samples.setdefault((transport, stream), {"direct_p50_ms": [], "gateway_p50_ms": [],
                                                                   "gateway_cpu_ms": [], "rps": []})
                    row["direct_p50_ms"].append(statistics.median(direct) * 1000)
                    row["gateway_p50_ms"].append(statistics.median(through) * 1000)
                    row["gateway_cpu_ms"].append(cpu if cpu is not None else float("nan"))
                    row["rps"].append(rps)
        channel.close()
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
    rows = []
    for (transport, stream), values in samples.items():
        medians = {name: statistics.median(series) for name, series in values.items()}
        rows.append({"transport": transport, "stream": stream, **medians,
                     "added_p50_ms": medians["gateway_p50_ms"] - medians["direct_p50_ms"], "per_round": values})
    by_key = {(row["transport"], row["stream"]): row for row in rows}
    ratios = {}
    for stream in (False, True):
        http, grpc_row = by_key[("http", stream)], by_key[("grpc", stream)]
        ratios["stream" if stream else "unary"] = {
            name: grpc_row[name] / http[name] for name in ("gateway_cpu_ms", "gateway_p50_ms", "rps")}
    return {"rounds": rounds, "requests": requests, "throughput_requests": throughput_requests, "rows": rows,
            "grpc_over_http": ratios}


def print_transports(result: dict) -> None:
    print(f"\nHTTP vs gRPC replicas (one kvik serve of a tiny random model; medians of {result['rounds']} paired "
          f"rounds of {result['requests']} sequential requests, {result['throughput_requests']} for throughput)\n")
    print(f"{'replica':8} {'stream':6} {'direct p50':>11} {'gateway p50':>12} {'added p50':>10} {'req/s':>7} "
          f"{'gateway CPU ms/req':>19}")
    by_key = {(row["transport"], row["stream"]): row for row in result["rows"]}
    for row in result["rows"]:
        print(f"{row['transport']:8} {str(row['stream']):6} {row['direct_p50_ms']:11.2f} {row['gateway_p50_ms']:12.2f} "
              f"{row['added_p50_ms']:10.2f} {row['rps']:7.0f} {row['gateway_cpu_ms']:19.2f}")
    for stream in (False, True):
        ratio = result["grpc_over_http"]["stream" if stream else "unary"]
        http, grpc_row = by_key[("http", stream)], by_key[("grpc", stream)]
        print(f"gRPC / HTTP, stream={stream}: gateway CPU per request {ratio['gateway_cpu_ms']:.2f}x, gateway p50 "
              f"{ratio['gateway_p50_ms']:.2f}x, throughput {ratio['rps']:.2f}x; added p50 "
              f"{grpc_row['added_p50_ms']:.2f} vs {http['added_p50_ms']:.2f} ms")


def _per_request_ms(before: float | None, after: float | None, requests: int) -> float | None:
    if before is None or after is None:
        return None
    return (after - before) * 1000 / requests


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
