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


def breaker_pool(replicas: int, panics: list[str] | None = None, **settings: float):  # noqa: ANN201
    from kvik.gateway.model_config import ModelConfig
    from kvik.gateway.router import ModelPool

    panic = settings.pop("panic_threshold_percent", 50.0)
    config = ModelConfig(name="m", replicas=[{"url": f"http://r{i}"} for i in range(replicas)])
    return ModelPool(config, BreakerConfig(consecutive_failures=2, **settings), panic_threshold_percent=panic,
                     on_panic=None if panics is None else panics.append)


def test_max_ejections_follows_envoy_and_never_takes_the_whole_pool() -> None:
    from kvik.gateway.router import max_ejections

    assert [max_ejections(n, 50) for n in (1, 2, 3, 4, 5, 10)] == [0, 1, 1, 2, 2, 5]
    assert [max_ejections(n, 10) for n in (1, 2, 10, 20)] == [0, 1, 1, 2]  # at least one, from two up
    assert [max_ejections(n, 100) for n in (1, 2, 3)] == [0, 1, 2]  # never all
    assert max_ejections(5, 0) == 0


def test_the_breakers_of_a_pool_never_eject_it_all() -> None:
    """Issue 10, finding 3: five failures can no longer take a model offline for everyone."""
    pool = breaker_pool(2)
    first, second = pool.replicas
    for _ in range(3):
        first.breaker.record_failure()
    assert first.breaker.state is BreakerState.OPEN
    for _ in range(10):
        second.breaker.record_failure()
    assert second.breaker.state is BreakerState.CLOSED  # the cap: one of two may be ejected
    single = breaker_pool(1)
    for _ in range(10):
        single.replicas[0].breaker.record_failure()
    assert single.replicas[0].breaker.state is BreakerState.CLOSED


def test_panic_routing_tries_every_replica_when_too_few_are_available() -> None:
    from kvik.gateway.balancing import RoutingContext

    panics: list[str] = []
    pool = breaker_pool(2, panics)
    first, second = pool.replicas
    first.healthy = False
    assert pool.pick(RoutingContext()) is second and panics == []  # 1 of 2 available: 50 %, no panic
    second.healthy = False
    assert pool.pick(RoutingContext()) in (first, second) and panics == ["m"]  # 0 of 2: panic
    assert pool.pick(RoutingContext(), {first}) is second
    assert pool.pick(RoutingContext(), {first, second}) is None  # each replica once per request
    off = breaker_pool(2, panic_threshold_percent=0)
    for replica in off.replicas:
        replica.healthy = False
    assert off.pick(RoutingContext()) is None
