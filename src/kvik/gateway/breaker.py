"""Per-replica circuit breaker: closed -> open -> half-open -> closed.

Closed: every outcome is counted in a rolling window of one-second buckets. The breaker opens when the
window holds at least `volume_threshold` outcomes and `error_threshold_percent` of them are failures,
or at once after `consecutive_failures` failures in a row (passive ejection of a dead replica).
Open: no traffic for `sleep_window_s`. Half-open: up to `half_open_probes` trial requests go through;
one success closes the breaker with a fresh window, one failure opens it for another sleep window.

Ask-then-act: `can_attempt()` is side-effect free (the balancer filters with it); `on_attempt()`
claims a half-open probe slot for the replica actually chosen.

A closed breaker opens only when `may_open()` agrees: the pool it belongs to caps how many of its
replicas may be ejected at once (Envoy's max_ejection_percent), so failures that look like the
replicas' fault can never take a whole model offline.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from enum import IntEnum

from kvik.gateway.config import BreakerConfig


class BreakerState(IntEnum):
    # Values are what the `kvik_gateway_breaker_state` gauge exports.
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    def __init__(self, config: BreakerConfig, *, clock: Callable[[], float] = time.monotonic,
                 on_transition: Callable[[BreakerState], None] | None = None,
                 may_open: Callable[[], bool] | None = None) -> None:
        self._config = config
        self._clock = clock
        self._on_transition = on_transition
        self._may_open = may_open
        self._state = BreakerState.CLOSED
        self._opened_at = 0.0
        self._probes_in_flight = 0
        self._consecutive_failures = 0
        # (second, successes, failures) buckets, oldest first, covering at most `window_s`.
        self._buckets: deque[list[int]] = deque()

    def reconfigure(self, config: BreakerConfig) -> None:
        """New thresholds from a config reload; the state and the counts so far are kept."""
        self._config = config

    @property
    def state(self) -> BreakerState:
        """The current state; an open breaker whose sleep window has passed reads as half-open."""
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self._config.sleep_window_s:
            self._transition(BreakerState.HALF_OPEN)
        return self._state

    @property
    def ejected(self) -> bool:
        """Open or half-open: the replica is out of normal rotation."""
        return self.state is not BreakerState.CLOSED

    def retry_after(self) -> float:
        """Seconds until an open breaker lets a probe through (0 when it already would)."""
        if self.state is not BreakerState.OPEN:
            return 0.0
        return max(0.0, self._opened_at + self._config.sleep_window_s - self._clock())

    def can_attempt(self) -> bool:
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.HALF_OPEN:
            return self._probes_in_flight < self._config.half_open_probes
        return False

    def on_attempt(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self._probes_in_flight += 1

    def record_success(self) -> None:
        self._consecutive_failures = 0
        if self.state is BreakerState.HALF_OPEN:
            self._probes_in_flight = max(0, self._probes_in_flight - 1)
            self._close()
            return
        self._bucket()[1] += 1

    def record_failure(self) -> None:
        self._consecutive_failures += 1
        state = self.state
        if state is BreakerState.HALF_OPEN:
            self._probes_in_flight = max(0, self._probes_in_flight - 1)
            self._open()
            return
        if state is BreakerState.OPEN:
            return  # a straggler that started before the breaker opened
        self._bucket()[2] += 1
        tripped = self._consecutive_failures >= self._config.consecutive_failures or self._error_rate_tripped()
        if tripped and (self._may_open is None or self._may_open()):
            self._open()

    def record_neutral(self) -> None:
        """An attempt that proved nothing either way (client went away): release a probe slot."""
        if self._state is BreakerState.HALF_OPEN:
            self._probes_in_flight = max(0, self._probes_in_flight - 1)

    def _error_rate_tripped(self) -> bool:
        self._expire()
        successes = sum(bucket[1] for bucket in self._buckets)
        failures = sum(bucket[2] for bucket in self._buckets)
        total = successes + failures
        return total >= self._config.volume_threshold and (
            100.0 * failures / total >= self._config.error_threshold_percent)

    def _bucket(self) -> list[int]:
        second = int(self._clock())
        if not self._buckets or self._buckets[-1][0] != second:
            self._buckets.append([second, 0, 0])
            self._expire()
        return self._buckets[-1]

    def _expire(self) -> None:
        oldest = int(self._clock() - self._config.window_s)
        while self._buckets and self._buckets[0][0] <= oldest:
            self._buckets.popleft()

    def _open(self) -> None:
        self._opened_at = self._clock()
        self._probes_in_flight = 0
        self._transition(BreakerState.OPEN)

    def _close(self) -> None:
        self._buckets.clear()
        self._consecutive_failures = 0
        self._probes_in_flight = 0
        self._transition(BreakerState.CLOSED)

    def _transition(self, new_state: BreakerState) -> None:
        old_state, self._state = self._state, new_state
        if self._on_transition is not None and old_state is not new_state:
            self._on_transition(new_state)
