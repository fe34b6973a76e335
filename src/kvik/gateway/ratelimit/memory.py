"""In-process counters: exact for one gateway; several gateways each enforce the full limit."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from kvik.gateway.ratelimit.backend import CounterBackend
from kvik.gateway.ratelimit.window import Decision, WindowCounts, decide

_MAX_COUNTERS = 100_000


class MemoryCounters(CounterBackend):
    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._counters: dict[str, list[float]] = {}  # name -> [window index, current, previous]

    async def hit(self, name: str, limit: int, cost: int, window_s: float, *, count: bool = True) -> Decision:
        counter, counts = self._roll(name, window_s)
        decision = decide(counts, limit, cost, window_s)
        if decision.allowed and count:
            counter[1] += cost
        return decision

    async def add(self, name: str, cost: int, window_s: float) -> None:
        counter, _ = self._roll(name, window_s)
        counter[1] = max(0.0, counter[1] + cost)

    def _roll(self, name: str, window_s: float) -> tuple[list[float], WindowCounts]:
        now = self._clock()
        index = math.floor(now / window_s)
        counter = self._counters.get(name)
        if counter is None:
            if len(self._counters) >= _MAX_COUNTERS:
                self._evict(index)
            counter = self._counters[name] = [index, 0.0, 0.0]
        elif counter[0] != index:
            # The current window became the previous one, or both are older than a window.
            counter[2] = counter[1] if counter[0] == index - 1 else 0.0
            counter[0], counter[1] = index, 0.0
        return counter, WindowCounts(counter[1], counter[2], (now % window_s) / window_s)

    def _evict(self, index: int) -> None:
        for name in [n for n, c in self._counters.items() if c[0] < index - 1]:
            del self._counters[name]
