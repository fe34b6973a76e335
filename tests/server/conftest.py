"""Real `kvik serve` processes on 127.0.0.1 for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    process: subprocess.Popen
    url: str
    log_path: Path
    model_name: str

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


def start_server(model_dir: Path, log_dir: Path, *extra: str, name: str = "tiny",
                 timeout: float = 90.0, env: dict[str, str] | None = None) -> ServerProcess:
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    # Stored Responses API responses stay in the test's directory (a later --responses-store wins).
    command = [sys.executable, "-m", "kvik.cli.main", "serve", "--model", str(model_dir),
               "--port", str(port), "--served-model-name", name, "--max-model-len", "512",
               "--responses-store", str(log_dir / f"responses-{port}.sqlite"), *extra]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log_path, name)
    wait_until_ready(server, timeout)
    return server


def wait_until_ready(server: ServerProcess, timeout: float) -> None:
    """Poll /health until 200; stop the server and raise with its log if it exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server not ready in {timeout}s:\n{server.log()}")


@pytest.fixture(scope="session")
def server_factory(tmp_path_factory, tiny_llama):
    started: list[ServerProcess] = []
    log_dir = tmp_path_factory.mktemp("server-logs")

    def start(*extra: str, model_dir: Path | None = None, name: str = "tiny",
              env: dict[str, str] | None = None) -> ServerProcess:
        server = start_server(model_dir or tiny_llama, log_dir, *extra, name=name, env=env)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def server(server_factory) -> ServerProcess:
    """One shared server for tests that do not change its state."""
    return server_factory()


def metric_value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)
