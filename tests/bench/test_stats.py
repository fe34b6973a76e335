"""Percentiles, TPOT, goodput and throughput against figures computed by hand."""

from __future__ import annotations

import pytest

from kvik.bench.stats import SLO, RequestRecord, first_errors, format_table, percentile, summarize
from kvik.core.errors import ConfigError


def test_percentile_interpolates_between_order_statistics():
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 * (4 - 3)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 100) == 4.0
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_tpot_excludes_the_first_token():
    record = RequestRecord(index=0, success=True, ttft_s=0.5, e2e_s=1.5, output_tokens=11)
    assert record.tpot_s == pytest.approx(0.1)
    assert RequestRecord(index=1, success=True, ttft_s=0.5, e2e_s=0.5, output_tokens=1).tpot_s is None
    assert RequestRecord(index=2, success=False, ttft_s=0.5, e2e_s=1.5, output_tokens=11).tpot_s is None


def test_slo_parsing():
    assert SLO.parse("ttft=2000,tpot=200") == SLO(ttft_ms=2000, tpot_ms=200)
    assert SLO.parse(" TTFT = 500 ") == SLO(ttft_ms=500)
    assert SLO.parse("") == SLO() and SLO.parse(None) == SLO()
    assert SLO(ttft_ms=2000, tpot_ms=200).describe() == "ttft=2000,tpot=200"
    for bad in ("e2e=5", "ttft=fast", "ttft"):
        with pytest.raises(ConfigError):
            SLO.parse(bad)


def hand_records() -> list[RequestRecord]:
    return [
        # within both objectives: TPOT (1.1 - 0.1) / 10 = 100 ms
        RequestRecord(0, True, start_s=0.0, prompt_tokens=20, expected_output_tokens=11, output_tokens=11,
                      ttft_s=0.1, e2e_s=1.1, itl_s=[0.1] * 10),
        # TTFT 3 s misses the 2 s objective
        RequestRecord(1, True, start_s=1.0, prompt_tokens=30, expected_output_tokens=6, output_tokens=6,
                      ttft_s=3.0, e2e_s=3.5, itl_s=[0.1] * 5),
        # TPOT 300 ms misses the 200 ms objective; 5 tokens where 8 were asked for
        RequestRecord(2, True, start_s=2.0, prompt_tokens=10, expected_output_tokens=8, output_tokens=5,
                      ttft_s=0.5, e2e_s=1.7, itl_s=[0.3] * 4),
        RequestRecord(3, False, error="HTTP 500: boom", start_s=3.0, prompt_tokens=99,
                      expected_output_tokens=4),
        # one token: no TPOT, so only TTFT is judged
        RequestRecord(4, True, start_s=4.0, prompt_tokens=5, expected_output_tokens=1, output_tokens=1,
                      ttft_s=0.2, e2e_s=0.2),
    ]


def test_summary_figures_match_hand_computation():
    summary = summarize(hand_records(), duration_s=10.0, slo=SLO(ttft_ms=2000, tpot_ms=200))
    assert (summary["num_requests"], summary["completed"], summary["failed"]) == (5, 4, 1)
    assert summary["output_length_mismatches"] == 1
    assert summary["total_input_tokens"] == 65  # the failed request's prompt does not count
    assert summary["total_output_tokens"] == 23
    assert summary["request_throughput"] == pytest.approx(0.4)
    assert summary["output_throughput"] == pytest.approx(2.3)
    assert summary["total_token_throughput"] == pytest.approx(8.8)
    assert summary["goodput"] == pytest.approx(0.2)  # requests 0 and 4 in 10 s
    assert summary["slo_attainment"] == pytest.approx(0.4)
    # TTFT sorted: 0.1 0.2 0.5 3.0
    assert summary["mean_ttft_ms"] == pytest.approx(950)
    assert summary["p50_ttft_ms"] == pytest.approx(350)
    assert summary["p99_ttft_ms"] == pytest.approx(1000 * (0.5 + 0.97 * 2.5))
    # TPOT: 0.1 0.1 0.3
    assert summary["mean_tpot_ms"] == pytest.approx(1000 * 0.5 / 3)
    assert summary["p50_tpot_ms"] == pytest.approx(100)
    # ITLs pooled over requests: fifteen gaps of 0.1 s and four of 0.3 s
    assert summary["mean_itl_ms"] == pytest.approx(1000 * 2.7 / 19)
    assert summary["p50_itl_ms"] == pytest.approx(100)
    assert summary["p99_itl_ms"] == pytest.approx(300)
    assert summary["p50_e2e_ms"] == pytest.approx(1000 * (1.1 + 1.7) / 2)


def test_goodput_without_objectives_counts_every_success():
    summary = summarize(hand_records(), duration_s=2.0, slo=SLO())
    assert summary["goodput"] == pytest.approx(2.0)
    assert summary["slo"] == "none"


def test_summary_of_all_failures_has_empty_latencies():
    summary = summarize([RequestRecord(0, False, error="x")], duration_s=1.0, slo=SLO(ttft_ms=1))
    assert summary["completed"] == 0 and summary["goodput"] == 0
    assert summary["p99_ttft_ms"] is None and summary["mean_itl_ms"] is None
    assert "TTFT" in format_table(summary)  # renders '-' for missing figures


def test_table_shows_the_figures():
    summary = summarize(hand_records(), duration_s=10.0, slo=SLO(ttft_ms=2000, tpot_ms=200))
    table = format_table(summary, "demo")
    assert "4 / 5" in table
    assert "Output length != max_tokens" in table
    ttft_row = next(line for line in table.splitlines() if line.startswith("TTFT"))
    assert ttft_row.split()[1:3] == ["950.00", "350.00"]


def test_first_errors_are_distinct_and_in_order():
    errors = [None, "HTTP 503", "HTTP 503", None, "timeout", "HTTP 500", "other"]
    assert first_errors(errors) == ["HTTP 503", "timeout", "HTTP 500"]
