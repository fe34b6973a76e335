"""The naive baseline and a real `kvik serve` on 127.0.0.1, started side by side once per session."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.support.processes import ServerProcess, free_port, serve_command


@pytest.fixture(scope="session")
def servers(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """{'naive': ..., 'kvik': ...} serving the same tiny model as 'tiny'; both boot concurrently."""
    logs = tmp_path_factory.mktemp("bench-servers")
    naive_port, kvik_port = free_port(), free_port()
    started = {
        "naive": ServerProcess([sys.executable, "-m", "kvik.bench.naive_server", "--model", str(tiny_llama),
                                "--served-model-name", "tiny", "--port", str(naive_port)],
                               naive_port, logs / "naive.log", env={"OMP_NUM_THREADS": "1"}, stop_timeout=20),
        "kvik": ServerProcess(serve_command(kvik_port, model_dir=tiny_llama), kvik_port, logs / "kvik.log",
                              env={"OMP_NUM_THREADS": "1"}, model_name="tiny", stop_timeout=20),
    }
    try:
        for server in started.values():
            server.launch()
        for server in started.values():
            server.wait_ready(120)
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="session")
def naive(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["naive"]


@pytest.fixture(scope="session")
def kvik_server(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["kvik"]
