"""One upstream replica as the gateway sees it: its address, load, health and breaker."""

from __future__ import annotations

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

    def is_available(self) -> bool:
        return self.healthy and self.breaker.can_attempt()

    def begin_attempt(self) -> None:
        self.outstanding += 1
        self.breaker.on_attempt()

    def finish_attempt(self, outcome: Outcome) -> None:
        self.outstanding -= 1
        if outcome is Outcome.SUCCESS:
            self.breaker.record_success()
        elif outcome is Outcome.FAILURE:
            self.breaker.record_failure()
        else:
            self.breaker.record_neutral()
