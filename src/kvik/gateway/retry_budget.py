"""Retry budget: retries over a sliding 10 s window may not exceed a fraction of the requests seen in
it, plus a small floor. Failing over from one dead replica is cheap; multiplying the load on a fleet
that is already failing everywhere is how outages spread, so the budget caps it."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from kvik.gateway.config import RetryConfig

WINDOW_S = 10


class RetryBudget:
    def __init__(self, config: RetryConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self._buckets: deque[list[int]] = deque()  # [second, requests, retries]

    def reconfigure(self, config: RetryConfig) -> None:
        """Reloaded ratios; the window's counts are kept."""
        self._config = config

    def record_request(self) -> None:
        self._bucket()[1] += 1

    def try_spend(self) -> bool:
        """Claim one retry if the budget allows it."""
        bucket = self._bucket()
        requests = sum(b[1] for b in self._buckets)
        retries = sum(b[2] for b in self._buckets)
        allowed = self._config.min_retries_per_s * WINDOW_S + self._config.budget_ratio * requests
        if retries + 1 > allowed:
            return False
        bucket[2] += 1
        return True

    def _bucket(self) -> list[int]:
        second = int(self._clock())
        if not self._buckets or self._buckets[-1][0] != second:
            self._buckets.append([second, 0, 0])
            while self._buckets[0][0] <= second - WINDOW_S:
                self._buckets.popleft()
        return self._buckets[-1]
