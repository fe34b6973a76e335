"""Latency-vs-load plots from `kvik bench serve --json` result files.

One line per label (say kvik and the naive baseline), one point per result file, x the load (the
request rate by default). Latency panels use a log scale: an overloaded baseline's TTFT is orders of
magnitude above a healthy server's, and both must stay readable on one figure.
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from kvik.core.errors import ConfigError

# (summary key, panel title, log scale)
PANELS = (
    ("p50_ttft_ms", "TTFT p50 (ms)", True),
    ("p99_ttft_ms", "TTFT p99 (ms)", True),
    ("output_throughput", "output throughput (tok/s)", False),
    ("p50_tpot_ms", "TPOT p50 (ms)", True),
    ("p99_tpot_ms", "TPOT p99 (ms)", True),
    ("goodput", "goodput (req/s within SLO)", False),
)


def load_result(path: Path) -> dict[str, Any]:
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable result file ({exc})") from None
    if not isinstance(result, dict) or "summary" not in result or "config" not in result:
        raise ConfigError(f"{path}: not a `kvik bench serve --json` result (no summary/config)")
    return result


def x_value(result: dict[str, Any], x: str) -> float | None:
    """The run's `x` from its config or summary; None when missing or not finite (rate inf)."""
    value = result["config"].get(x, result["summary"].get(x))
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def label_of(result: dict[str, Any]) -> str:
    return result.get("label") or result["config"].get("model") or "run"


Points = list[tuple[float, dict[str, Any]]]  # (x, summary) per run


def series(results: list[tuple[Path, dict[str, Any]]], x: str) -> dict[str, Points]:
    """label -> [(x, summary)] sorted by x; runs without a finite x are skipped with a note on stderr."""
    lines: dict[str, Points] = defaultdict(list)
    for path, result in results:
        value = x_value(result, x)
        if value is None:
            print(f"kvik bench plot: skipping {path}: no finite '{x}'", file=sys.stderr)
            continue
        lines[label_of(result)].append((value, result["summary"]))
    return {label: sorted(points, key=lambda p: p[0]) for label, points in lines.items()}


def plot_results(paths: list[Path], out: Path, x: str = "request_rate") -> Path:
    """Write a PNG of TTFT, TPOT, throughput and goodput against `x`, one line per label."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogFormatter

    lines = series([(p, load_result(p)) for p in paths], x)
    if not lines:
        raise ConfigError(f"no result file has a finite '{x}' to plot against")
    figure, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    for axis, (key, title, log_scale) in zip(axes.flat, PANELS):
        for label, points in lines.items():
            xs = [px for px, summary in points if summary.get(key) is not None]
            ys = [summary[key] for _, summary in points if summary.get(key) is not None]
            axis.plot(xs, ys, marker="o", label=label)
        if log_scale and axis.has_data():
            axis.set_yscale("log")
            # Plain numbers (150, not 1.5x10^2); minor ticks are labelled only on short ranges.
            axis.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
            axis.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
        axis.set_title(title)
        axis.set_xlabel(x.replace("_", " "))
        axis.grid(True, alpha=0.3)
    axes.flat[0].legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out
