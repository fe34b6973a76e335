"""`bench/sampler.py`, run small: every setting on both logit shapes, kvik beside HF, one line each."""

from __future__ import annotations

import pytest

from tests.bench.scripts import run_bench_script


def test_sampler_bench_prints_a_line_per_setting():
    result = run_bench_script("sampler.py", "--vocab", "300", "--rows", "1,3", "--repeats", "1", timeout=300)
    assert result.returncode == 0, result.stderr
    lines = [line.split() for line in result.stdout.splitlines() if line.strip().startswith("300")]
    assert len(lines) == 2 * 2 * 5  # rows x logit shapes x settings
    assert {line[3] for line in lines} == {"greedy", "T=0.8", "top_p=0.9", "top_k=40", "logprobs=1"}
    assert all(float(line[4]) > 0 and float(line[5]) > 0 and line[6].endswith("x") for line in lines)


@pytest.mark.parametrize("flags,named", [(["--repeats", "0"], "--repeats"), (["--vocab", "big"], "--vocab"),
                                         (["--rows", "0,16"], "--rows"), (["--vocab", ""], "--vocab")])
def test_sampler_bench_refuses_bad_flags(flags, named):
    result = run_bench_script("sampler.py", *flags)
    assert result.returncode == 2 and named in result.stderr and "Traceback" not in result.stderr
