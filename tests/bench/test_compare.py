"""`kvik bench compare`'s single-stream decode measurement, run small on the tiny model: it pairs
every decode step with a read of the same bytes and reports both, in a child process of its own."""

from __future__ import annotations

import json

from kvik.bench.compare import run_decode, single_stream_decode
from kvik.bench.roofline import ModelShape


def test_decode_pairs_each_step_with_a_read(tiny_llama):
    bytes_per_token = ModelShape.from_model_dir(str(tiny_llama)).decode_bytes_per_token()
    result = single_stream_decode(str(tiny_llama), bytes_per_token, prompt_len=8, tokens=12, windows=3)
    assert len(result["window_fractions"]) == 3
    assert result["decode_tokens_per_second"] > 0 and result["read_bandwidth"] > 0
    # The whole-run fraction is the windows' pooled ratio, so it lies within their range.
    assert min(result["window_fractions"]) <= result["decode_bandwidth_fraction"] <= max(result["window_fractions"])


def test_decode_runs_in_its_own_process(tiny_llama, tmp_path):
    bytes_per_token = ModelShape.from_model_dir(str(tiny_llama)).decode_bytes_per_token()
    result = run_decode(str(tiny_llama), bytes_per_token, tmp_path)
    assert result == json.loads((tmp_path / "decode.json").read_text())
    assert len(result["window_fractions"]) == 8 and result["decode_bandwidth_fraction"] > 0
