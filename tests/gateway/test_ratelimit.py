"""Sliding-window limits: the arithmetic, the memory counters, and the Redis script on a real Redis."""

from __future__ import annotations

import asyncio

import pytest

from kvik.gateway.ratelimit.memory import MemoryCounters
from kvik.gateway.ratelimit.window import WindowCounts, decide, seconds_until_room


def test_estimate_weights_the_previous_window() -> None:
    assert WindowCounts(current=2, previous=10, elapsed_fraction=0.25).estimate() == 9.5


def test_retry_after_within_the_current_window() -> None:
    # estimate = 10 * (1 - 0.5) + 0 = 5 against limit 5: room for 1 when 10 * (1 - f) <= 4, f = 0.6.
    counts = WindowCounts(current=0, previous=10, elapsed_fraction=0.5)
    assert decide(counts, limit=5, cost=1, window_s=60).allowed is False
    assert seconds_until_room(counts, 5, 1, 60) == pytest.approx(6.0)


def test_retry_after_in_the_next_window() -> None:
    # current 5 of limit 5 at 90 %: the rest of this window (6 s), then 5 * (1 - f) <= 4, f = 0.2 (12 s).
    counts = WindowCounts(current=5, previous=0, elapsed_fraction=0.9)
    assert seconds_until_room(counts, 5, 1, 60) == pytest.approx(18.0)


class Clock:
    def __init__(self) -> None:
        self.now = 6000.0  # the start of a 60 s window

    def __call__(self) -> float:
        return self.now


def test_memory_counters_admit_up_to_the_limit_then_recover() -> None:
    clock = Clock()
    counters = MemoryCounters(clock=clock)

    async def run() -> None:
        for _ in range(3):
            assert (await counters.hit("k:rpm", 3, 1, 60)).allowed
        refused = await counters.hit("k:rpm", 3, 1, 60)
        assert not refused.allowed and refused.retry_after_s > 0
        clock.now += 120  # two windows later nothing is left
        assert (await counters.hit("k:rpm", 3, 1, 60)).allowed
        # check-only (count=False) never consumes; add() charges unconditionally
        await counters.add("k:tpm", 100, 60)
        assert not (await counters.hit("k:tpm", 50, 1, 60, count=False)).allowed

    asyncio.run(run())


def test_redis_counters_are_atomic_under_concurrency(redis_server: str) -> None:
    import redis.asyncio as redis_asyncio

    from kvik.gateway.ratelimit.redis import RedisCounters

    async def run() -> None:
        # Two clients stand for two gateways: together they may admit exactly `limit`.
        clients = [redis_asyncio.from_url(redis_server) for _ in range(2)]
        counters = [RedisCounters(c, prefix="kvik:test-atomic:") for c in clients]
        results = await asyncio.gather(*(counters[i % 2].hit("key", 25, 1, 60) for i in range(60)))
        assert sum(r.allowed for r in results) == 25
        refused = [r for r in results if not r.allowed]
        assert all(0 < r.retry_after_s <= 120 for r in refused)
        await counters[0].add("tokens", 500, 60)
        assert not (await counters[1].hit("tokens", 100, 1, 60, count=False)).allowed
        for client in clients:
            await client.aclose()

    asyncio.run(run())
