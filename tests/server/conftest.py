"""Real `kvik serve` processes on 127.0.0.1 for the server tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.support.processes import ServerProcess, free_port, start_kvik_serve


def start_server(model_dir: Path, log_dir: Path, *extra: str, name: str = "tiny",
                 timeout: float = 90.0, env: dict[str, str] | None = None) -> ServerProcess:
    """A ready `kvik serve` of `model_dir` answering to `name`, with a 512-token context."""
    # Stored Responses API responses stay in the test's directory (a later --responses-store wins).
    port = free_port()
    return start_kvik_serve(log_dir, "--responses-store", str(log_dir / f"responses-{port}.sqlite"), *extra,
                            model_dir=model_dir, name=name, timeout=timeout, env=env, port=port)


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



@pytest.fixture(scope="session")
def hermes_model_dir(model_dir_factory, tmp_path_factory) -> Path:
    """A Qwen3-style model (Hermes tool calls, <think> reasoning) with random weights."""
    from tests.server.chat_formats import HERMES_THINKING_TEMPLATE, THINK_TOKENS, dress_model

    return dress_model(model_dir_factory("qwen3"), tmp_path_factory.mktemp("hermes") / "model",
                       HERMES_THINKING_TEMPLATE, THINK_TOKENS)


@pytest.fixture(scope="session")
def llama3_model_dir(model_dir_factory, tmp_path_factory) -> Path:
    """A Llama-3.1-style model (JSON tool calls with "parameters") with random weights."""
    from tests.server.chat_formats import LLAMA3_TEMPLATE, dress_model

    return dress_model(model_dir_factory("llama"), tmp_path_factory.mktemp("llama3") / "model",
                       LLAMA3_TEMPLATE)


@pytest.fixture(scope="session")
def hermes_thinking_server(server_factory, hermes_model_dir) -> ServerProcess:
    """The formats come from the chat template: no parser flags. The tiny vocabulary spends
    hundreds of tokens on tool descriptions, hence the longer context."""
    return server_factory("--max-model-len", "2048", model_dir=hermes_model_dir)


@pytest.fixture(scope="session")
def llama3_server(server_factory, llama3_model_dir) -> ServerProcess:
    return server_factory("--max-model-len", "2048", model_dir=llama3_model_dir)
