"""Least outstanding requests, weighted: the replica with the fewest in-flight requests per unit of
weight. A replica that answers faster finishes more, so it is offered more: the split follows each
replica's real capacity. Ties rotate, so idle sequential traffic (always a tie at zero) still
alternates instead of piling onto the first replica."""

from __future__ import annotations

from collections.abc import Sequence

from kvik.gateway.balancing.base import BalancingStrategy, RoutingContext
from kvik.gateway.replica import Replica


class Rotation:
    """Round robin among equals. The counter moves only when there is a choice to make; moving it on
    every pick would make ties, which often come every other pick, always fall on the same side."""

    def __init__(self) -> None:
        self._count = 0

    def pick(self, tied: Sequence[Replica]) -> Replica:
        if len(tied) == 1:
            return tied[0]
        self._count += 1
        return tied[self._count % len(tied)]


class LeastOutstanding(BalancingStrategy):
    name = "least_outstanding"

    def __init__(self, replicas: Sequence[Replica]) -> None:
        super().__init__(replicas)
        self._rotation = Rotation()

    def choose(self, candidates: Sequence[Replica], context: RoutingContext) -> Replica:
        return least_loaded(candidates, self._rotation)


def least_loaded(candidates: Sequence[Replica], rotation: Rotation) -> Replica:
    """The least-loaded candidate; `rotation` picks among equally loaded ones."""
    lowest = min(r.outstanding / r.weight for r in candidates)
    return rotation.pick([r for r in candidates if r.outstanding / r.weight == lowest])
