"""Load-balancing strategies in isolation."""

from __future__ import annotations

from collections import Counter

from kvik.gateway.balancing import RoutingContext, make_strategy
from kvik.gateway.balancing.prefix_affinity import affinity_key
from kvik.gateway.config import BreakerConfig
from kvik.gateway.model_config import ModelConfig
from kvik.gateway.router import ModelPool


def pool(balancing: str, weights: tuple[float, ...] = (1, 1)) -> ModelPool:
    config = ModelConfig(name="m", balancing=balancing,
                         replicas=[{"url": f"http://r{i}", "weight": w} for i, w in enumerate(weights)])
    return ModelPool(config, BreakerConfig())


def test_least_outstanding_prefers_idle_and_alternates_ties() -> None:
    p = pool("least_outstanding")
    a, b = p.replicas
    a.outstanding = 3
    assert all(p.pick(RoutingContext()) is b for _ in range(5))
    a.outstanding = 0
    picks = Counter(p.pick(RoutingContext()).url for _ in range(100))
    assert picks == {"http://r0": 50, "http://r1": 50}


def test_least_outstanding_respects_weight() -> None:
    p = pool("least_outstanding", (1, 2))
    a, b = p.replicas
    a.outstanding, b.outstanding = 1, 1
    assert p.pick(RoutingContext()) is b  # 1/2 < 1/1


def test_weighted_round_robin_is_smooth_and_proportional() -> None:
    p = pool("weighted_round_robin", (1, 3))
    sequence = [p.pick(RoutingContext()).url[-1] for _ in range(8)]
    assert sequence.count("1") == 6 and sequence.count("0") == 2
    assert "11111" not in "".join(sequence * 2)  # the heavy replica's turns are spread out


def test_pick_skips_unavailable_and_excluded_replicas() -> None:
    p = pool("weighted_round_robin")
    a, b = p.replicas
    a.healthy = False
    assert {p.pick(RoutingContext()).url for _ in range(4)} == {"http://r1"}
    assert p.pick(RoutingContext(), exclude={b}) is None


def test_prefix_affinity_is_sticky_and_falls_back() -> None:
    p = pool("prefix_affinity")
    turn1 = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    turn2 = {"messages": [*turn1["messages"], {"role": "assistant", "content": "hello"},
                          {"role": "user", "content": "more"}]}
    assert affinity_key(turn1, 256) == affinity_key(turn2, 256)
    context = p.routing_context(turn2)
    home = p.pick(context)
    assert all(p.pick(context) is home for _ in range(10))
    other = next(r for r in p.replicas if r is not home)
    home.outstanding = 20  # much busier than the other (0 * 2 + 4)
    assert p.pick(context) is other
    home.outstanding = 3  # a little busier: stay for the warm cache
    assert p.pick(context) is home
    home.outstanding, home.healthy = 0, False
    assert p.pick(context) is other


def test_prefix_affinity_spreads_conversations() -> None:
    strategy = make_strategy(ModelConfig(name="m", balancing="prefix_affinity",
                                         replicas=[{"url": "http://r0"}, {"url": "http://r1"}]),
                             pool("least_outstanding").replicas)
    homes = Counter(strategy.affine_replica(f"conversation-{i}").url for i in range(1000))
    assert 400 < homes["http://r0"] < 600
