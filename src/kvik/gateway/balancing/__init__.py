"""Load-balancing strategies, one per file behind `BalancingStrategy`."""

from __future__ import annotations

from collections.abc import Sequence

from kvik.gateway.balancing.base import BalancingStrategy, RoutingContext
from kvik.gateway.balancing.least_outstanding import LeastOutstanding
from kvik.gateway.balancing.prefix_affinity import PrefixAffinity
from kvik.gateway.balancing.weighted_round_robin import WeightedRoundRobin
from kvik.gateway.model_config import ModelConfig
from kvik.gateway.replica import Replica

__all__ = ["BalancingStrategy", "RoutingContext", "make_strategy"]


def make_strategy(model: ModelConfig, replicas: Sequence[Replica]) -> BalancingStrategy:
    if model.balancing == "prefix_affinity":
        return PrefixAffinity(replicas, model.prefix_affinity)
    if model.balancing == "weighted_round_robin":
        return WeightedRoundRobin(replicas)
    return LeastOutstanding(replicas)
