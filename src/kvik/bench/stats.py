"""Per-request records and the figures computed from them: latency percentiles, throughput, goodput.

Definitions (as vLLM's `benchmark_serving` uses them, so figures compare across tools):
  TTFT  time to first token: request sent -> first content chunk received.
  ITL   inter-token latency: the gap between consecutive content chunks (pooled over all requests).
  TPOT  time per output token after the first: (e2e - TTFT) / (output_tokens - 1), per request.
  e2e   request sent -> stream finished.
  goodput  requests per second that succeeded and met every SLO.
Records hold seconds; the summary reports latencies in milliseconds (the `_ms` suffix says so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from kvik.core.errors import ConfigError

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")


@dataclass(slots=True)
class RequestRecord:
    """What the load generator measured for one request."""

    index: int
    success: bool = False
    error: str | None = None
    start_s: float = 0.0  # when it was sent, seconds after the benchmark started
    prompt_tokens: int | None = None
    expected_output_tokens: int | None = None  # max_tokens sent (exact with ignore_eos)
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two output tokens."""
        if not self.success or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "success": self.success, "error": self.error, "start_s": self.start_s,
                "prompt_tokens": self.prompt_tokens, "expected_output_tokens": self.expected_output_tokens,
                "output_tokens": self.output_tokens, "ttft_s": self.ttft_s, "tpot_s": self.tpot_s,
                "e2e_s": self.e2e_s, "itl_s": self.itl_s}


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency objectives in milliseconds; None means no objective on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> SLO:
        """'ttft=2000,tpot=200' -> SLO(2000, 200); '' or None -> no objectives."""
        values: dict[str, float] = {}
        for part in (text or "").split(","):
            if not part.strip():
                continue
            name, _, value = part.partition("=")
            name = name.strip().lower()
            if name not in ("ttft", "tpot"):
                raise ConfigError(f"--slo: unknown metric {name!r} (use ttft=MS,tpot=MS)")
            try:
                values[f"{name}_ms"] = float(value)
            except ValueError:
                raise ConfigError(f"--slo: {name} needs a number of milliseconds, got {value!r}") from None
        return cls(**values)

    def met_by(self, record: RequestRecord) -> bool:
        """Whether a request succeeded within every objective (TPOT is vacuous for one-token outputs)."""
        if not record.success or record.ttft_s is None:
            return False
        if self.ttft_ms is not None and record.ttft_s * 1000 > self.ttft_ms:
            return False
        tpot = record.tpot_s
        return self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms

    def describe(self) -> str:
        parts = [f"{name}={value:g}" for name, value in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms))
                 if value is not None]
        return ",".join(parts) or "none"


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def describe(values_s: Sequence[float], name: str) -> dict[str, float | None]:
    """mean_/p50_/p90_/p99_{name}_ms from values in seconds; None for every figure when there are none."""
    figures: dict[str, float | None] = {f"mean_{name}_ms": None}
    figures.update({f"p{q}_{name}_ms": None for q in PERCENTILES})
    if values_s:
        figures[f"mean_{name}_ms"] = 1000 * sum(values_s) / len(values_s)
        for q in PERCENTILES:
            figures[f"p{q}_{name}_ms"] = 1000 * percentile(values_s, q)
    return figures


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO) -> dict[str, Any]:
    """Every summary figure of a run, as a flat dict (the JSON `summary` and the printed table)."""
    done = [r for r in records if r.success]
    duration_s = max(duration_s, 1e-9)
    input_tokens = sum(r.prompt_tokens or 0 for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    good = sum(1 for r in done if slo.met_by(r))
    summary: dict[str, Any] = {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        # With ignore_eos every request should produce exactly max_tokens; anything else is a server bug
        # or a server that ignores ignore_eos, and makes the token figures incomparable.
        "output_length_mismatches": sum(1 for r in done if r.expected_output_tokens is not None
                                        and r.output_tokens != r.expected_output_tokens),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "slo": slo.describe(),
        "goodput": good / duration_s,
        "slo_attainment": good / len(records) if records else 0.0,
    }
    series = {
        "ttft": [r.ttft_s for r in done if r.ttft_s is not None],
        "tpot": [t for t in (r.tpot_s for r in done) if t is not None],
        "itl": [gap for r in done for gap in r.itl_s],
        "e2e": [r.e2e_s for r in done if r.e2e_s is not None],
    }
    for name in LATENCY_METRICS:
        summary.update(describe(series[name], name))
    return summary


def first_errors(errors: Iterable[str | None], limit: int = 3) -> list[str]:
    """The first `limit` distinct error messages among the requests' (to print under the table)."""
    seen: list[str] = []
    for error in errors:
        if error and error not in seen:
            seen.append(error)
        if len(seen) == limit:
            break
    return seen


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(summary: dict[str, Any], title: str = "Serving benchmark") -> str:
    """The summary as a fixed-width text table."""
    rows: list[tuple[str, str]] = [
        ("Successful requests", f"{summary['completed']} / {summary['num_requests']}"),
        ("Failed requests", str(summary["failed"])),
        ("Benchmark duration (s)", f"{summary['duration_s']:.2f}"),
        ("Total input tokens", str(summary["total_input_tokens"])),
        ("Total output tokens", str(summary["total_output_tokens"])),
        ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}"),
        (f"Goodput (req/s, SLO {summary['slo']})", f"{summary['goodput']:.2f}"),
        ("SLO attainment", f"{100 * summary['slo_attainment']:.1f} %"),
    ]
    if summary.get("output_length_mismatches"):
        rows.append(("Output length != max_tokens", str(summary["output_length_mismatches"])))
    width = 44
    lines = [f" {title} ".center(width + 12, "="),
             *(f"{name:<{width}}{value:>12}" for name, value in rows)]
    header = f"{'(ms)':<{width - 36}}{'mean':>12}{'p50':>12}{'p90':>12}{'p99':>12}"
    lines += ["-" * (width + 12), header]
    for name in LATENCY_METRICS:
        figures = [summary[f"{kind}_{name}_ms"] for kind in ("mean", "p50", "p90", "p99")]
        lines.append(f"{name.upper():<{width - 36}}" + "".join(f"{_ms(v):>12}" for v in figures))
    lines.append("=" * (width + 12))
    return "\n".join(lines)
