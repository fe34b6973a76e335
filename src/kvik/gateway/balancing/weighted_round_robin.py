"""Smooth weighted round robin (the nginx algorithm): weights 1 and 2 give A B B A B B ... with the
heavier replica's turns spread out rather than bunched."""

from __future__ import annotations

from collections.abc import Sequence

from kvik.gateway.balancing.base import BalancingStrategy, RoutingContext
from kvik.gateway.replica import Replica


class WeightedRoundRobin(BalancingStrategy):
    name = "weighted_round_robin"

    def __init__(self, replicas: Sequence[Replica]) -> None:
        super().__init__(replicas)
        self._current: dict[int, float] = {id(r): 0.0 for r in self.replicas}

    def choose(self, candidates: Sequence[Replica], context: RoutingContext) -> Replica:
        # Each round every candidate gains its weight; the leader is chosen and pays back the total.
        # Unavailable replicas sit out the round, so their share goes to the others.
        total = 0.0
        best: Replica | None = None
        for replica in candidates:
            self._current[id(replica)] += replica.weight
            total += replica.weight
            if best is None or self._current[id(replica)] > self._current[id(best)]:
                best = replica
        assert best is not None
        self._current[id(best)] -= total
        return best
