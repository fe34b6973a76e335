"""The one interface every load-balancing strategy implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from kvik.gateway.replica import Replica


@dataclass(slots=True, frozen=True)
class RoutingContext:
    """What a strategy may know about the request (never the request body itself)."""

    # Stable hash of the conversation prefix (system prompt and first user turn); None when the
    # request has no usable prefix. Only prefix affinity reads it.
    affinity_key: str | None = None


class BalancingStrategy(ABC):
    """Chooses one replica among `candidates`: healthy ones whose breaker lets a request through.

    Strategies are built once per model with the model's full replica list (prefix affinity needs a
    mapping that does not change when a replica is briefly unavailable).
    """

    name: str

    def __init__(self, replicas: Sequence[Replica]) -> None:
        self.replicas = list(replicas)

    @abstractmethod
    def choose(self, candidates: Sequence[Replica], context: RoutingContext) -> Replica:
        """`candidates` is non-empty and a subset of `self.replicas`."""
