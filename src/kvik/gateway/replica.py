"""One upstream replica as the gateway sees it: its address, load, health and breaker."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import Enum

from kvik.gateway.breaker import CircuitBreaker


class Outcome(Enum):
    """What one attempt on a replica tells the breaker."""

    SUCCESS = "success"
    FAILURE = "failure"  # connect error, timeout, 5xx: evidence the replica is unwell
    NEUTRAL = "neutral"  # 429, 4xx, client gone: says nothing about the replica's health


@dataclass(slots=True, eq=False)
class Replica:
    model: str  # the gateway's name for the model this replica serves
    url: str  # base URL without /v1, also the `replica` label in metrics and usage rows
    weight: float
    api_key: str | None
    breaker: CircuitBreaker
    healthy: bool = True  # from active probes; optimistic until the first probe says otherwise
    outstanding: int = 0  # attempts sent and not yet finished (streams count until their last byte)
    consecutive_probe_failures: int = field(default=0)
    consecutive_probe_successes: int = field(default=0)
    # Deadlines of the attempts on this replica that are still waiting for their first byte; when
    # the probes mark the replica down they expire at once, so those requests fail over instead of
    # waiting for a process that stopped answering.
    waiting: set[asyncio.Timeout] = field(default_factory=set)

    def is_available(self) -> bool:
        return self.healthy and self.breaker.can_attempt()

    def begin_attempt(self) -> None:
        self.outstanding += 1
        self.breaker.on_attempt()

    def finish_attempt(self, outcome: Outcome | None) -> None:
        """Release the attempt's slot and tell the breaker; `None` defers the verdict to `judge`
        (a 5xx that another replica may show to be the request's own fault)."""
        self.outstanding -= 1
        if outcome is not None:
            self.judge(outcome)

    def judge(self, outcome: Outcome) -> None:
        if outcome is Outcome.SUCCESS:
            self.breaker.record_success()
        elif outcome is Outcome.FAILURE:
            self.breaker.record_failure()
        else:
            self.breaker.record_neutral()

    def abandon_waiting(self) -> None:
        """Expire every attempt still waiting for its first byte (the replica went down)."""
        now = asyncio.get_running_loop().time()
        for deadline in list(self.waiting):
            deadline.reschedule(now)
