"""`kvik bench` wiring: cheap to import, plots from result files."""

from __future__ import annotations

import json
import subprocess
import sys

from kvik.bench.stats import SLO, RequestRecord, summarize
from kvik.cli.main import main
from tests.support.processes import free_port


def test_the_load_generator_never_imports_torch():
    code = ("import sys; from kvik.cli.main import build_parser; build_parser(); "
            "import kvik.bench.load, kvik.bench.stats, kvik.bench.workloads, kvik.bench.plot; "
            "heavy = [m for m in ('torch', 'transformers', 'fastapi', 'matplotlib') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bench_without_a_benchmark_prints_help(capsys):
    assert main(["bench"]) == 2
    assert "serve" in capsys.readouterr().out


def write_result(path, label, rate, ttft_s):
    records = [RequestRecord(i, True, prompt_tokens=10, expected_output_tokens=5, output_tokens=5,
                             ttft_s=ttft_s, e2e_s=ttft_s + 0.4, itl_s=[0.1] * 4) for i in range(4)]
    document = {"label": label, "config": {"request_rate": rate, "model": "tiny"},
                "summary": summarize(records, 2.0, SLO(ttft_ms=2000, tpot_ms=200)), "requests": []}
    path.write_text(json.dumps(document))
    return str(path)


def test_plot_writes_a_png_with_one_line_per_label(tmp_path, capsys):
    files = [write_result(tmp_path / f"{label}-{rate}.json", label, rate, ttft)
             for label, ttfts in (("kvik", (0.05, 0.08, 0.1)), ("naive", (0.2, 3.0, 12.0)))
             for rate, ttft in zip((1, 2, 4), ttfts)]
    files.append(write_result(tmp_path / "burst.json", "kvik", "inf", 0.5))  # no finite rate: skipped
    out = tmp_path / "plots" / "latency.png"
    assert main(["bench", "plot", *files, "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "skipping" in capsys.readouterr().err


def test_plot_rejects_files_that_are_not_results(tmp_path, capsys):
    path = tmp_path / "other.json"
    path.write_text('{"hello": 1}')
    assert main(["bench", "plot", str(path), "-o", str(tmp_path / "x.png")]) == 2
    assert "not a `kvik bench serve --json` result" in capsys.readouterr().err


def test_an_unreachable_server_is_named(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["bench", "serve", "--base-url", url, "--model", "tiny", "--no-progress"]) == 2
    assert f"could not reach the server at {url}" in capsys.readouterr().err
