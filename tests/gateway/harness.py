"""Real processes on 127.0.0.1 for the gateway tests (the fixtures in conftest.py build on these).

- `ServerProcess`, `free_port`, `wait_for`: from tests/support/processes.py (shared by every test
  that starts a server).
- `Upstream`: one replica. `upstream_command(port, name)` runs the fake OpenAI-compatible upstream
  (`fake_upstream.py`) unless KVIK_GATEWAY_TEST_UPSTREAM is `kvik-serve:MODEL_DIR`, which swaps in
  `kvik serve --model MODEL_DIR --port P --served-model-name NAME` (NAME is
  KVIK_GATEWAY_TEST_UPSTREAM_MODEL, default `tiny`); tests that need the fake's `/_received`,
  `/_control` or token arithmetic call `require_fake()` and are skipped then.
- `KvikServe`: one real `kvik serve` replica with `--log-prompts`, read back through its Prometheus
  counters and its per-request JSON log lines (test_e2e_kvik_serve.py).
- `Gateway`, `GatewayFactory`: write a config YAML and run `kvik gateway --config FILE --port P`.
- `PostgresCluster`: a private PostgreSQL (initdb + pg_ctl) in a temp dir on a free port.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from tests.support.processes import KVIK, REPO, ServerProcess, free_port, serve_command, wait_for

HERE = Path(__file__).resolve().parent
ADMIN_KEY = "kvik-test-admin-secret"
UPSTREAM_ENV = os.environ.get("KVIK_GATEWAY_TEST_UPSTREAM", "fake")
FAKE = not UPSTREAM_ENV.startswith("kvik-serve:")
# The model name the replicas serve (the fake answers to any name).
UPSTREAM_MODEL = os.environ.get("KVIK_GATEWAY_TEST_UPSTREAM_MODEL", "tiny")
STOP_TIMEOUT_S = 10.0  # SIGTERM to SIGKILL for the gateway tests' processes


def require_fake() -> None:
    """For tests that read the fake's `/_received`, drive its `/_control`, or count on its exact
    token accounting (prompt words + max_tokens)."""
    if not FAKE:
        pytest.skip("needs the fake upstream (KVIK_GATEWAY_TEST_UPSTREAM is set)")


def missing_service(reason: str) -> None:
    if os.environ.get("KVIK_TEST_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{reason} (KVIK_TEST_REQUIRE_SERVICES=1)")
    pytest.skip(reason)


def scrape_metric(url: str, name: str, *, headers: dict[str, str] | None = None, **labels: str) -> float:
    """Sum of the samples of `name` on `url`/metrics whose labels include `labels` (0 when none)."""
    response = httpx.get(url + "/metrics", headers=headers, timeout=5)
    response.raise_for_status()
    text = response.text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def kvik_serve_command(model_dir: str | Path, port: int, *, log_prompts: bool = False,
                       extra: Sequence[str] = ()) -> list[str]:
    """`kvik serve` on 127.0.0.1, answering to UPSTREAM_MODEL, with a short context (tiny models)."""
    return serve_command(port, *(["--log-prompts"] if log_prompts else []), *extra, model_dir=model_dir,
                         name=UPSTREAM_MODEL)


def upstream_command(port: int, name: str) -> list[str]:
    """The command line of one replica; the single place to swap the fake for `kvik serve`."""
    if FAKE:
        return [sys.executable, str(HERE / "fake_upstream.py"), "--port", str(port), "--name", name]
    return kvik_serve_command(UPSTREAM_ENV.split(":", 1)[1], port)


class Upstream(ServerProcess):
    def __init__(self, name: str, port: int, log_dir: Path) -> None:
        super().__init__(upstream_command(port, name), port, log_dir / f"upstream-{name}-{port}.log",
                         stop_timeout=STOP_TIMEOUT_S)
        self.name = name

    def restart(self) -> None:
        self.stop()
        self.start()

    def received(self) -> list[dict[str, Any]]:
        require_fake()
        return httpx.get(self.url + "/_received", timeout=5).json()["bodies"]

    def control(self, **changes: Any) -> None:
        require_fake()
        httpx.post(self.url + "/_control", json=changes, timeout=5).raise_for_status()

    def reset(self) -> None:
        if FAKE:
            httpx.post(self.url + "/_reset", timeout=5).raise_for_status()


class Gateway(ServerProcess):
    def __init__(self, config_path: Path, port: int, log_path: Path, env: dict[str, str]) -> None:
        super().__init__([*KVIK, "gateway", "--config", str(config_path), "--port", str(port)], port, log_path,
                         env=env, stop_timeout=STOP_TIMEOUT_S)
        self.config_path = config_path

    def client(self, key: str | None = None, timeout: float = 30.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def admin(self) -> httpx.Client:
        return self.client(ADMIN_KEY)

    def create_key(self, **spec: Any) -> str:
        with self.admin() as client:
            response = client.post("/admin/keys", json={"name": spec.pop("name", "test"), **spec})
        assert response.status_code == 201, response.text
        return response.json()["key"]

    def replicas(self, model: str = "tiny") -> dict[str, dict[str, Any]]:
        """Replica state of one model by URL (models may share replica URLs, with separate state)."""
        with self.admin() as client:
            return {r["url"]: r for r in client.get("/admin/replicas").json()["data"] if r["model"] == model}

    def rewrite_config(self, **changes: Any) -> None:
        """Replace top-level sections of the config file (the gateway sees it on reload)."""
        config = yaml.safe_load(self.config_path.read_text())
        config.update(changes)
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))

    def reload(self, key: str = ADMIN_KEY) -> httpx.Response:
        """POST /admin/config/reload."""
        with self.client(key) as client:
            return client.post("/admin/config/reload")

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 when none); /metrics needs
        an admin key by default."""
        return scrape_metric(self.url, name, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, **labels)


class KvikServe(ServerProcess):
    """A real `kvik serve` replica with `--log-prompts`: one JSON line per request, prompt included.

    Its log file is appended to across restarts, so `request_log()` covers every incarnation, while
    its Prometheus counters start again from zero in each."""

    REQUEST_LOG_MARK = "kvik.server.requests: "

    def __init__(self, name: str, model_dir: Path, port: int, log_dir: Path, *, grpc_port: int | None = None,
                 extra: Sequence[str] = ()) -> None:
        self.grpc_port = grpc_port  # also serves kvik's gRPC API there (`--grpc-port`) when set
        # One torch thread: two replicas, a gateway and the test share two busy cores. The PyTorch
        # attention path: the compiled CPU kernel is built on first use (30-50 s on two busy cores)
        # in a build directory that other checkouts on the machine rebuild for their own torch, and
        # these tests are about the gateway, not the kernel.
        grpc_flags = ["--grpc-port", str(grpc_port)] if grpc_port is not None else []
        # Each replica keeps stored Responses in a store of its own, as separate hosts would.
        store = ["--responses-store", str(log_dir / f"responses-{name}-{port}.sqlite")]
        super().__init__(kvik_serve_command(model_dir, port, log_prompts=True, extra=[*store, *extra, *grpc_flags]),
                         port,
                         log_dir / f"kvik-serve-{name}-{port}.log",
                         env={"OMP_NUM_THREADS": "1", "KVIK_CPU_KERNELS": "0"}, model_name=UPSTREAM_MODEL,
                         stop_timeout=STOP_TIMEOUT_S)
        self.name = name

    @property
    def grpc_url(self) -> str:
        """The replica URL the gateway reaches its gRPC API at."""
        assert self.grpc_port is not None, "started without a gRPC port"
        return f"grpc://127.0.0.1:{self.grpc_port}"

    def replica_url(self, transport: str) -> str:
        """This replica in a gateway config: over HTTP ("http") or kvik's gRPC API ("grpc")."""
        return self.grpc_url if transport == "grpc" else self.url

    def warm_up(self, concurrency: int = 8) -> None:
        """Direct requests in one batch, so first-use costs (new batch shapes) are paid before any
        test measures where traffic goes."""
        async def batch() -> None:
            async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:
                responses = await asyncio.gather(*(client.post("/v1/completions", json={
                    "model": UPSTREAM_MODEL, "prompt": f"warm up {i}", "max_tokens": 4})
                    for i in range(concurrency)))
            assert all(r.status_code == 200 for r in responses), [r.text for r in responses]

        asyncio.run(batch())

    def requests_served(self) -> int:
        """Finished requests of this incarnation, from `kvik:request_success_total` (n=1 requests)."""
        return int(scrape_metric(self.url, "kvik:request_success_total"))

    def request_log(self) -> list[dict[str, Any]]:
        """The server's per-request log lines (`event: request`), oldest first. A replica killed
        with SIGKILL can leave its last entry cut off mid-line, with whatever is written next (its
        orphaned resource tracker's warning, the next incarnation's first entry) on the same line:
        each entry is decoded on its own, and a cut one is skipped."""
        decoder = json.JSONDecoder()
        lines = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            for payload in line.split(self.REQUEST_LOG_MARK)[1:]:
                try:
                    lines.append(decoder.raw_decode(payload)[0])
                except json.JSONDecodeError:
                    continue
        return lines

    def prompts_containing(self, text: str) -> list[str]:
        """The logged prompts (chat: after the chat template) that contain `text`."""
        return [json.dumps(entry.get("prompt"), ensure_ascii=False) for entry in self.request_log()
                if text in json.dumps(entry.get("prompt"), ensure_ascii=False)]


class GatewayFactory:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.started: list[Gateway] = []

    def start(self, config: dict[str, Any], name: str = "gateway") -> Gateway:
        """Start `kvik gateway` with `config` on top of test defaults (fast probes, admin key, SQLite)."""
        full = {
            "auth": {"enabled": True, "admin_key": "env:KVIK_TEST_ADMIN_KEY", "key_cache_ttl_s": 0.5},
            "database_url": f"sqlite:///{self.workdir / (name + '.db')}",
            "health": {"interval_s": 0.5, "timeout_s": 1.0, "unhealthy_after": 1},
            **config,
        }
        config_path = self.workdir / f"{name}.yaml"
        config_path.write_text(yaml.safe_dump(full, sort_keys=False))
        env = {"KVIK_TEST_ADMIN_KEY": ADMIN_KEY,
               # The moderation hook used by the tests lives next to this file.
               "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        gateway = Gateway(config_path, free_port(), self.workdir / f"{name}.log", env)
        self.started.append(gateway)
        return gateway.start()

    def stop_all(self) -> None:
        for gateway in self.started:
            gateway.stop()


def model_config(name: str, upstreams: Sequence[ServerProcess], **extra: Any) -> dict[str, Any]:
    return {"name": name, "upstream_model": UPSTREAM_MODEL, "replicas": [{"url": u.url} for u in upstreams], **extra}


class RedisServer(ServerProcess):
    """A private redis-server: no persistence, loopback only."""

    def __init__(self, binary: str, port: int, workdir: Path) -> None:
        super().__init__([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                          "--dir", str(workdir)], port, workdir / "redis.log", stop_timeout=STOP_TIMEOUT_S)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def ready(self) -> bool:
        import redis

        try:
            with redis.Redis(port=self.port, socket_timeout=1) as client:
                return bool(client.ping())
        except redis.ConnectionError:
            return False


class PostgresCluster:
    """A private PostgreSQL cluster (initdb + pg_ctl). Postgres refuses to run as root, so as root the
    server runs as the `postgres` user via runuser."""

    def __init__(self) -> None:
        bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        initdb = bins[-1] if bins else shutil.which("initdb")
        if initdb is None:
            missing_service("PostgreSQL is not installed (apt-get install -y postgresql)")
        self.bin = Path(initdb).parent
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="kvik-pg-"))
        self.data = self.root / "data"
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
            self.as_user = ["runuser", "-u", "postgres", "--"]

    def _run(self, *argv: str) -> None:
        result = subprocess.run([*self.as_user, *argv], capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed: {result.stdout}\n{result.stderr}")

    def start(self) -> None:
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                  "--no-sync", "-E", "UTF8")
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                   f"-c synchronous_commit=off -c full_page_writes=off -c shared_buffers=16MB")
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "server.log"),
                  "-o", options, "-w", "-t", "60", "start")

    def stop(self) -> None:
        try:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)
