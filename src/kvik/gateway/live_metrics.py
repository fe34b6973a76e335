"""Request rate, error rate and latency percentiles over the last seconds, computed from the gateway's
own Prometheus registry, for the admin console's live view.

Each call takes a snapshot of the cumulative counters and histogram buckets; rates and percentiles
come from the difference to the oldest snapshot inside the window, exactly as Prometheus' `rate()`
and `histogram_quantile()` would compute them (linear interpolation inside a bucket). Snapshots are
taken only when someone looks, so a gateway without an open console does no work for this.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

REQUESTS = "kvik_gateway_requests"
LATENCY = "kvik_gateway_request_duration_seconds"
TTFT = "kvik_gateway_time_to_first_token_seconds"
KEEP_S = 900.0  # the longest window a caller may ask for
MIN_SNAPSHOT_GAP_S = 0.25
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(slots=True)
class Snapshot:
    at: float  # time.monotonic()
    requests: float = 0.0
    errors: float = 0.0  # status >= 500 (the gateway's or a replica's fault)
    rejected: float = 0.0  # status 4xx (the client's request refused: auth, limits, validation)
    histograms: dict[str, dict[float, float]] = field(default_factory=dict)  # name -> le -> cumulative count


class LiveMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._snapshots: deque[Snapshot] = deque()

    def summary(self, windows: tuple[float, ...] = (10.0, 60.0, 300.0)) -> dict[str, Any]:
        now = self._snapshot()
        return {"windows": {str(int(w)): self._window(now, w) for w in windows},
                "totals": {"requests": now.requests, "errors": now.errors, "rejected": now.rejected}}

    def _snapshot(self) -> Snapshot:
        now = time.monotonic()
        if self._snapshots and now - self._snapshots[-1].at < MIN_SNAPSHOT_GAP_S:
            return self._snapshots[-1]
        snap = Snapshot(at=now)
        for family in self._registry.collect():
            if family.name == REQUESTS:
                for sample in family.samples:
                    if not sample.name.endswith("_total"):
                        continue
                    status = sample.labels.get("status", "")
                    snap.requests += sample.value
                    if status.startswith("5"):
                        snap.errors += sample.value
                    elif status.startswith("4"):
                        snap.rejected += sample.value
            elif family.name in (LATENCY, TTFT):
                buckets: dict[float, float] = {}
                for sample in family.samples:
                    if sample.name.endswith("_bucket"):
                        le = float(sample.labels["le"])
                        buckets[le] = buckets.get(le, 0.0) + sample.value
                snap.histograms[family.name] = buckets
        self._snapshots.append(snap)
        while self._snapshots and now - self._snapshots[0].at > KEEP_S:
            self._snapshots.popleft()
        return snap

    def _window(self, now: Snapshot, window_s: float) -> dict[str, Any]:
        # The oldest snapshot still inside the window; with none older than `now`, the gateway's
        # whole life so far (counters start at zero) stands in for the window.
        base = next((s for s in self._snapshots if now.at - s.at <= window_s and s is not now), None)
        span = now.at - base.at if base is not None else None
        base = base or Snapshot(at=now.at)
        requests = now.requests - base.requests
        result: dict[str, Any] = {
            "seconds": round(span, 3) if span else None,
            "requests": requests,
            "requests_per_s": round(requests / span, 4) if span else None,
            "errors": now.errors - base.errors,
            "rejected": now.rejected - base.rejected,
        }
        for name, key in ((LATENCY, "latency_ms"), (TTFT, "ttft_ms")):
            delta = _delta(now.histograms.get(name, {}), base.histograms.get(name, {}))
            result[key] = {f"p{int(q * 100)}": _quantile(q, delta) for q in QUANTILES}
        return result


def _delta(now: dict[float, float], base: dict[float, float]) -> list[tuple[float, float]]:
    return sorted((le, count - base.get(le, 0.0)) for le, count in now.items())


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Milliseconds; None without observations. Within the +Inf bucket the answer is the highest
    finite bound (as Prometheus does)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    counts = [count for _, count in buckets]
    index = bisect.bisect_left(counts, rank)
    index = min(index, len(buckets) - 1)
    upper, upper_count = buckets[index]
    if math.isinf(upper):
        finite = [le for le, _ in buckets if not math.isinf(le)]
        return round(finite[-1] * 1000, 3) if finite else None
    lower, lower_count = (0.0, 0.0) if index == 0 else buckets[index - 1]
    in_bucket = upper_count - lower_count
    fraction = (rank - lower_count) / in_bucket if in_bucket > 0 else 1.0
    return round((lower + (upper - lower) * fraction) * 1000, 3)
