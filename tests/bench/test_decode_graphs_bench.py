"""`bench/decode_graphs.py`, run on the CPU (its --device cpu check of the script itself: no graphs
there): a row per batch size with kvik and HF rates, the JSON beside it, and bad flags refused."""

from __future__ import annotations

import json

import pytest

from tests.bench.scripts import run_bench_script


def test_decode_graphs_bench_runs_on_the_cpu(tiny_llama, tmp_path):
    out = tmp_path / "decode.json"
    result = run_bench_script("decode_graphs.py", "--model", str(tiny_llama), "--device", "cpu",
                              "--dtype", "float32", "--batch-sizes", "1,3", "--tokens", "4", "--prompt-len", "6",
                              "--kv-cache-memory", "32MiB", "--json", str(out), timeout=300)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1] in (["1"], ["3"])]
    assert [row[0] for row in rows] == ["1", "3"]
    assert all(float(value) > 0 for row in rows for value in row[1:4])
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["results"]] == [1, 3] and report["device"] == "CPU"


@pytest.mark.parametrize("flags,named", [(["--batch-sizes", "1,x"], "--batch-sizes"),
                                         (["--batch-sizes", "0"], "--batch-sizes"),
                                         (["--tokens", "1"], "--tokens")])
def test_decode_graphs_bench_refuses_bad_flags(tiny_llama, flags, named):
    result = run_bench_script("decode_graphs.py", "--model", str(tiny_llama), "--device", "cpu", *flags)
    assert result.returncode == 2 and named in result.stderr and "Traceback" not in result.stderr
