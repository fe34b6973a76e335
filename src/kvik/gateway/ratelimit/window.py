"""Sliding-window counter arithmetic, shared by the memory and Redis backends.

Counts are kept per fixed window (one minute for RPM and TPM) for the current and the previous
window. The estimate for "the last minute" weights the previous window by how much of it still
overlaps: `previous * (1 - elapsed_fraction) + current`. Two integers per key, no burst of twice
the limit at a window edge as fixed windows allow, and exact enough for rate limiting.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class WindowCounts:
    current: float  # units counted in the current window
    previous: float  # units counted in the previous window
    elapsed_fraction: float  # how far into the current window we are, in [0, 1)

    def estimate(self) -> float:
        return self.previous * (1.0 - self.elapsed_fraction) + self.current


@dataclass(slots=True, frozen=True)
class Decision:
    allowed: bool
    retry_after_s: float = 0.0  # when refused: seconds until `cost` more units would fit


def decide(counts: WindowCounts, limit: float, cost: float, window_s: float) -> Decision:
    if counts.estimate() + cost <= limit:
        return Decision(True)
    return Decision(False, seconds_until_room(counts, limit, cost, window_s))


def seconds_until_room(counts: WindowCounts, limit: float, cost: float, window_s: float) -> float:
    """Smallest wait after which `estimate + cost <= limit`, assuming no other traffic meanwhile."""
    room = limit - cost  # the estimate must fall to this
    if room < 0:
        return window_s  # never fits; a full window is the honest "not soon"
    f, cur, prev = counts.elapsed_fraction, counts.current, counts.previous
    if cur <= room:
        # Still within this window: prev * (1 - f - t/W) + cur <= room.
        if prev <= 0:
            return 0.0
        return max(0.0, window_s * (1.0 - f - (room - cur) / prev))
    # Only after this window ends, when the current count becomes the previous one:
    # cur * (1 - f') <= room.
    return (1.0 - f) * window_s + window_s * max(0.0, 1.0 - room / cur)
