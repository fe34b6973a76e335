"""Where rate-limit counters live: this process (memory) or Redis (shared by all gateways)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvik.gateway.ratelimit.window import Decision


class CounterBackend(ABC):
    @abstractmethod
    async def hit(self, name: str, limit: int, cost: int, window_s: float, *, count: bool = True) -> Decision:
        """Admit `cost` units under `limit` per `window_s` and, when admitted and `count`, record them.
        Check and record are one atomic step, so concurrent gateways cannot both take the last unit."""

    @abstractmethod
    async def add(self, name: str, cost: int, window_s: float) -> None:
        """Record units unconditionally; a negative cost gives back part of a reservation (the
        current window's count never goes below zero)."""

    async def close(self) -> None:
        return None
