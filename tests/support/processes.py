"""Real server processes on 127.0.0.1 for every test that starts one: `kvik serve`, the gateway, the
bench's naive server, fake upstreams, Redis.

- `ServerProcess`: a subprocess with its output in a log file, on a port picked by `free_port`;
  `start` waits until its health path answers 200 and raises with the log's tail if the process
  exits or the wait times out; `stop` terminates by pid, then kills after `stop_timeout` seconds.
- `serve_command`, `start_kvik_serve`: the `kvik serve` command line the tests share.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
KVIK = [sys.executable, "-m", "kvik.cli.main"]
LOG_TAIL_CHARS = 6000  # of a process's log in a failure message


_HANDED_OUT: set[int] = set()  # every port free_port has returned in this test process


def free_port() -> int:
    """A port no one listens on right now (the OS picks it) and that this process has not handed out
    before. Callers often pick two ports before starting the process that binds both (`--port` and
    `--grpc-port`); the OS may give the second call the port it just gave the first, since nothing
    listens on it yet, and then the server fails to bind its second listener."""
    for _ in range(1000):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no free port that this test process has not handed out already")


def wait_for(condition: Callable[[], bool], timeout: float = 15.0, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


class ServerProcess:
    """A server subprocess with its output appended to `log_path`; `start` waits until it answers."""

    def __init__(self, argv: list[str], port: int, log_path: Path, *, env: dict[str, str] | None = None,
                 health_path: str = "/health", model_name: str | None = None, stop_timeout: float = 30.0) -> None:
        self.argv, self.port, self.log_path = argv, port, log_path
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.health_path = health_path
        self.model_name = model_name  # what a `kvik serve` answers to, when it is one
        self.stop_timeout = stop_timeout  # seconds between SIGTERM and SIGKILL
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI SDK's base URL."""
        return f"{self.url}/v1"

    def start(self, timeout: float = 60.0) -> ServerProcess:
        self.launch()
        return self.wait_ready(timeout)

    def launch(self) -> None:
        """Start the process without waiting (several servers can then load side by side)."""
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO)

    def wait_ready(self, timeout: float = 60.0) -> ServerProcess:
        """Poll the health path until 200; stop the process and raise with its log tail if it exits
        or `timeout` seconds pass."""
        assert self.process is not None, "launch() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.argv} exited with {self.process.returncode}:\n{self.log_tail()}")
            if self.ready():
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.argv} did not become ready in {timeout} s:\n{self.log_tail()}")

    def ready(self) -> bool:
        try:
            return httpx.get(self.url + self.health_path, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def kill9(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after `stop_timeout` seconds; the exit status (None if never started)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.terminate()
            try:
                return self.process.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        return self.log()[-chars:]


def serve_command(port: int, *extra: str, model_dir: str | Path | None = None, name: str | None = "tiny",
                  max_model_len: int | None = 512) -> list[str]:
    """`kvik serve` on 127.0.0.1:`port`; no `model_dir` serves the default model. Later flags in
    `extra` override earlier ones."""
    # No drain announce: a test server stops at once on SIGTERM unless the test asks for it (later
    # flags win).
    argv = [*KVIK, "serve", "--port", str(port), "--drain-announce-seconds", "0"]
    if model_dir is not None:
        argv += ["--model", str(model_dir)]
    if name is not None:
        argv += ["--served-model-name", name]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    return [*argv, *extra]


def start_kvik_serve(log_dir: Path, *extra: str, model_dir: str | Path | None, name: str | None = "tiny",
                     max_model_len: int | None = 512, timeout: float = 90.0, env: dict[str, str] | None = None,
                     port: int | None = None) -> ServerProcess:
    """A ready `kvik serve` on `port` (default: a free one), its log in `log_dir/server-PORT.log`."""
    port = port or free_port()
    server = ServerProcess(serve_command(port, *extra, model_dir=model_dir, name=name, max_model_len=max_model_len),
                           port, log_dir / f"server-{port}.log", env={"OMP_NUM_THREADS": "1", **(env or {})},
                           model_name=name)
    return server.start(timeout)
