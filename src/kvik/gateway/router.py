"""Routing: a request's `model` (a name or an alias) to the pool of replicas serving it."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from kvik.core.errors import ModelNotFoundError
from kvik.core.tracing import traced
from kvik.gateway.balancing import BalancingStrategy, RoutingContext, make_strategy
from kvik.gateway.balancing.prefix_affinity import affinity_key
from kvik.gateway.breaker import BreakerState, CircuitBreaker
from kvik.gateway.config import BreakerConfig, GatewayConfig, ModelConfig
from kvik.gateway.replica import Replica

logger = logging.getLogger("kvik.gateway.router")

# Called as (model, replica url, new state) on every breaker transition; metrics listen here.
BreakerListener = Callable[[str, str, BreakerState], None]


def max_ejections(replicas: int, max_ejection_percent: float) -> int:
    """How many of a pool's replicas may be ejected at once: the percentage rounded down, but at
    least one when there are two or more (Envoy's rule), and never every replica."""
    if max_ejection_percent <= 0 or replicas < 2:
        return 0
    return min(replicas - 1, max(1, math.floor(replicas * max_ejection_percent / 100)))


class ModelPool:
    """The replicas of one model and the strategy that spreads requests over them."""

    def __init__(self, config: ModelConfig, breaker_config: BreakerConfig,
                 on_breaker_transition: BreakerListener | None = None, *,
                 panic_threshold_percent: float = 50.0, on_panic: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.name = config.name
        self.upstream_model = config.upstream_model or config.name
        self.panic_threshold_percent = panic_threshold_percent
        self.max_ejections = max_ejections(len(config.replicas), breaker_config.max_ejection_percent)
        self._on_panic = on_panic  # told the model's name at each pick made in panic mode
        self.replicas = [
            Replica(model=config.name, url=r.url, weight=r.weight, api_key=r.api_key,
                    breaker=CircuitBreaker(breaker_config,
                                           on_transition=_bind(on_breaker_transition, config.name, r.url),
                                           may_open=self._may_eject))
            for r in config.replicas
        ]
        self.strategy: BalancingStrategy = make_strategy(config, self.replicas)

    def _may_eject(self) -> bool:
        ejected = sum(1 for r in self.replicas if r.breaker.ejected)
        if ejected < self.max_ejections:
            return True
        logger.warning("%s: not ejecting another replica, %d of %d already are (max_ejection_percent)",
                       self.name, ejected, len(self.replicas))
        return False

    def routing_context(self, body: dict) -> RoutingContext:
        if self.config.balancing != "prefix_affinity":
            return RoutingContext()  # skip hashing the prompt when no strategy reads the key
        return RoutingContext(affinity_key(body, self.config.prefix_affinity.prompt_prefix_chars))

    def pick(self, context: RoutingContext, exclude: set[Replica] | frozenset[Replica] = frozenset()
             ) -> Replica | None:
        """A replica for the next attempt, or None when every untried replica is unavailable.

        Panic routing: when fewer than `panic_threshold_percent` of the replicas are available, every
        replica is a candidate again (Envoy's panic threshold), since a pool that judges all of its
        replicas bad is more likely wrong about them than right."""
        available = [r for r in self.replicas if r.is_available()]
        if len(available) * 100 < self.panic_threshold_percent * len(self.replicas):
            candidates = [r for r in self.replicas if r not in exclude]
            if candidates and self._on_panic is not None:
                self._on_panic(self.name)
        else:
            candidates = [r for r in available if r not in exclude]
        if not candidates:
            return None
        return self.strategy.choose(candidates, context)

    def seconds_until_available(self) -> float:
        """A Retry-After hint when no replica is available: the soonest breaker sleep window end."""
        waits = [r.breaker.retry_after() for r in self.replicas if r.healthy]
        return min(waits, default=5.0) or 1.0


class ModelRouter:
    def __init__(self, config: GatewayConfig, on_breaker_transition: BreakerListener | None = None,
                 on_panic: Callable[[str], None] | None = None) -> None:
        self.pools = [ModelPool(m, config.breaker, on_breaker_transition,
                                panic_threshold_percent=config.health.panic_threshold_percent, on_panic=on_panic)
                      for m in config.models]
        self._by_name: dict[str, ModelPool] = {}
        for pool in self.pools:
            for name in (pool.name, *pool.config.aliases):
                self._by_name[name] = pool

    @traced("route")
    def resolve(self, model: str) -> ModelPool:
        pool = self._by_name.get(model)
        if pool is None:
            raise ModelNotFoundError(
                f"The model {model!r} does not exist on this gateway; GET /v1/models lists the models "
                f"it serves.", param="model")
        return pool

    def all_replicas(self) -> list[Replica]:
        return [replica for pool in self.pools for replica in pool.replicas]


def _bind(listener: BreakerListener | None, model: str, url: str) -> Callable[[BreakerState], None] | None:
    if listener is None:
        return None
    return lambda state: listener(model, url, state)
