"""The circuit breaker, driven by a fake clock."""

from __future__ import annotations

from kvik.gateway.breaker import BreakerState, CircuitBreaker
from kvik.gateway.config import BreakerConfig


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock, **settings: float) -> tuple[CircuitBreaker, list[BreakerState]]:
    seen: list[BreakerState] = []
    return CircuitBreaker(BreakerConfig(**settings), clock=clock, on_transition=seen.append), seen


def test_opens_at_error_threshold_only_after_volume_threshold() -> None:
    clock = Clock()
    breaker, _ = make(clock, consecutive_failures=100)
    for _ in range(9):  # 9 successes and 10 failures: 19 requests, under the volume of 20
        breaker.record_success()
    for i in range(10):
        breaker.record_failure()
        breaker.record_success() if i == 9 else None
    assert breaker.state is BreakerState.CLOSED  # 20 requests, 10 failures = 50 %, but the 20th was a success
    breaker.record_failure()  # 21 requests, 11 failures: over 50 %
    assert breaker.state is BreakerState.OPEN
    assert not breaker.can_attempt()


def test_old_outcomes_leave_the_window() -> None:
    clock = Clock()
    breaker, _ = make(clock, consecutive_failures=100, window_s=10)
    for _ in range(15):  # 45 requests, a third failed: closed
        breaker.record_failure()
        breaker.record_success()
        breaker.record_success()
    clock.now += 11  # everything above is out of the window now
    for _ in range(5):  # 5 failures alone: under the volume threshold
        breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED


def test_consecutive_failures_trip_at_once() -> None:
    clock = Clock()
    breaker, seen = make(clock, consecutive_failures=3)
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN and seen == [BreakerState.OPEN]


def test_half_open_probe_closes_or_reopens() -> None:
    clock = Clock()
    breaker, seen = make(clock, consecutive_failures=1, sleep_window_s=5, half_open_probes=1)
    breaker.record_failure()
    clock.now += 4.9
    assert not breaker.can_attempt() and 0 < breaker.retry_after() < 0.11
    clock.now += 0.2
    assert breaker.state is BreakerState.HALF_OPEN and breaker.can_attempt()
    breaker.on_attempt()
    assert not breaker.can_attempt()  # one probe at a time
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN  # the probe failed: another sleep window
    clock.now += 5.1
    breaker.on_attempt()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.can_attempt()
    assert seen == [BreakerState.OPEN, BreakerState.HALF_OPEN, BreakerState.OPEN, BreakerState.HALF_OPEN,
                    BreakerState.CLOSED]


def test_neutral_outcome_frees_the_probe_slot() -> None:
    clock = Clock()
    breaker, _ = make(clock, consecutive_failures=1, sleep_window_s=1)
    breaker.record_failure()
    clock.now += 2
    breaker.on_attempt()
    breaker.record_neutral()
    assert breaker.state is BreakerState.HALF_OPEN and breaker.can_attempt()
