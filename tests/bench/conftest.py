"""The naive baseline and a real `kvik serve` on 127.0.0.1, started side by side once per session."""

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
class Server:
    process: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def launch(argv: list[str], log_path: Path) -> Server:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, *argv, "--port", str(port)], stdout=log,
                                   stderr=subprocess.STDOUT, env=env)
    return Server(process, f"http://127.0.0.1:{port}", log_path)


def wait_healthy(server: Server, timeout: float = 120.0) -> None:
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
    raise RuntimeError(f"server not healthy within {timeout}s:\n{server.log()}")


@pytest.fixture(scope="session")
def servers(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Server]:
    """{'naive': ..., 'kvik': ...} serving the same tiny model as 'tiny'; both boot concurrently."""
    logs = tmp_path_factory.mktemp("bench-servers")
    started = {
        "naive": launch(["-m", "kvik.bench.naive_server", "--model", str(tiny_llama),
                         "--served-model-name", "tiny"], logs / "naive.log"),
        "kvik": launch(["-m", "kvik.cli.main", "serve", "--model", str(tiny_llama), "--served-model-name",
                        "tiny", "--max-model-len", "512"], logs / "kvik.log"),
    }
    try:
        for server in started.values():
            wait_healthy(server)
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="session")
def naive(servers: dict[str, Server]) -> Server:
    return servers["naive"]


@pytest.fixture(scope="session")
def kvik_server(servers: dict[str, Server]) -> Server:
    return servers["kvik"]
