"""One upstream replica as the gateway sees it: its address, load, health and breaker."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from kvik.gateway.breaker import CircuitBreaker

logger = logging.getLogger("kvik.gateway.replica")

# Sent by a replica that is shutting down (`kvik serve` after SIGTERM, on /health and on every
# response): the gateway routes nothing new to it, and its in-flight requests finish.
DRAIN_HEADER = "x-kvik-draining"


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
    # Added by a reload or by discovery: no traffic, not even in panic mode, until a probe passes.
    awaiting_probe: bool = False
    # The replica said it is shutting down (`x-kvik-draining` on a response or its health probe):
    # no new requests; the ones it has finish. Cleared when a probe finds it serving again.
    drain_announced: bool = False
    # Removed from the config or from discovery: out of its pool; dropped once `outstanding` is 0.
    retired: bool = False
    on_drained: Callable[[Replica], None] | None = None  # called once a retired replica has no attempt left

    def is_available(self) -> bool:
        return self.in_rotation() and self.healthy and self.breaker.can_attempt()

    def in_rotation(self) -> bool:
        """May take new requests at all (panic routing too): not draining, retired or unprobed."""
        return not (self.drain_announced or self.retired or self.awaiting_probe)

    @property
    def phase(self) -> str:
        """One word for the admin API: retired, draining, awaiting_probe, down or up."""
        if self.retired:
            return "retired"
        if self.drain_announced:
            return "draining"
        if self.awaiting_probe:
            return "awaiting_probe"
        return "up" if self.healthy else "down"

    def begin_attempt(self) -> None:
        self.outstanding += 1
        self.breaker.on_attempt()

    def finish_attempt(self, outcome: Outcome | None) -> None:
        """Release the attempt's slot and tell the breaker; `None` defers the verdict to `judge`
        (a 5xx that another replica may show to be the request's own fault)."""
        self.outstanding -= 1
        if outcome is not None:
            self.judge(outcome)
        if self.retired and self.outstanding == 0 and self.on_drained is not None:
            self.on_drained(self)

    def judge(self, outcome: Outcome) -> None:
        if outcome is Outcome.SUCCESS:
            self.breaker.record_success()
        elif outcome is Outcome.FAILURE:
            self.breaker.record_failure()
        else:
            self.breaker.record_neutral()

    def announce_drain(self, where: str) -> None:
        """The replica said it is shutting down: out of rotation at once (logged once)."""
        if not self.drain_announced:
            self.drain_announced = True
            logger.warning("replica %s of %s is draining (said in %s): no new requests go to it",
                           self.url, self.model, where)

    def abandon_waiting(self) -> None:
        """Expire every attempt still waiting for its first byte (the replica went down)."""
        now = asyncio.get_running_loop().time()
        for deadline in list(self.waiting):
            deadline.reschedule(now)
