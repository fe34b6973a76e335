"""Routing: a request's `model` (a name or an alias) to the pool of replicas serving it."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvik.core.errors import ModelNotFoundError
from kvik.core.tracing import traced
from kvik.gateway.balancing import BalancingStrategy, RoutingContext, make_strategy
from kvik.gateway.balancing.prefix_affinity import affinity_key
from kvik.gateway.breaker import BreakerState, CircuitBreaker
from kvik.gateway.config import BreakerConfig, GatewayConfig
from kvik.gateway.model_config import ModelConfig, ReplicaConfig
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


@dataclass(slots=True)
class MembershipChange:
    """What one reload or discovery result did to the replica set."""

    added: list[Replica] = field(default_factory=list)
    retired: list[Replica] = field(default_factory=list)  # draining; dropped when their last attempt ends
    models_added: list[str] = field(default_factory=list)
    models_removed: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.retired or self.models_added or self.models_removed)


class ModelPool:
    """The replicas of one model and the strategy that spreads requests over them.

    The replica set is live: `configure` takes a new model section, `set_discovered` the replicas a
    discovery source found, and `sync` turns the union of fixed and discovered replicas into the
    pool, keeping the `Replica` (breaker, load, health) of every URL that stays."""

    def __init__(self, config: ModelConfig, breaker_config: BreakerConfig,
                 on_breaker_transition: BreakerListener | None = None, *,
                 panic_threshold_percent: float = 50.0, on_panic: Callable[[str], None] | None = None,
                 live: bool = False, discovered: dict[str, list[ReplicaConfig]] | None = None) -> None:
        self._on_breaker_transition = on_breaker_transition
        self._on_panic = on_panic  # told the model's name at each pick made in panic mode
        self.replicas: list[Replica] = []
        # Source ("dns", "file") -> the replicas it found; the router's own dict for this model.
        self.discovered: dict[str, list[ReplicaConfig]] = discovered if discovered is not None else {}
        self.configure(config, breaker_config, panic_threshold_percent=panic_threshold_percent)
        self.sync(live=live)

    def configure(self, config: ModelConfig, breaker_config: BreakerConfig, *,
                  panic_threshold_percent: float) -> None:
        """Take a (possibly changed) model section; `sync` then applies its replica list."""
        self.config = config
        self.name = config.name
        self.upstream_model = config.upstream_model or config.name
        self.panic_threshold_percent = panic_threshold_percent
        self.breaker_config = breaker_config
        for replica in self.replicas:
            replica.breaker.reconfigure(breaker_config)
        self._strategy_stale = True

    def members(self) -> list[ReplicaConfig]:
        """Fixed replicas, then discovered ones; a URL listed twice counts once (the first wins)."""
        seen: dict[str, ReplicaConfig] = {}
        for member in [*self.config.replicas, *(r for found in self.discovered.values() for r in found)]:
            seen.setdefault(member.url, member)
        return list(seen.values())

    def sync(self, *, live: bool = True) -> MembershipChange:
        """Make the pool match `members()`. Kept URLs keep their state (weights and keys are
        updated); new ones wait for a good probe when `live`; the rest are retired."""
        change = MembershipChange()
        current = {replica.url: replica for replica in self.replicas}
        replicas = []
        for member in self.members():
            replica = current.pop(member.url, None)
            if replica is None:
                replica = self._new_replica(member, live)
                change.added.append(replica)
                self._strategy_stale = True
            elif (replica.weight, replica.api_key) != (member.weight, member.api_key):
                replica.weight, replica.api_key = member.weight, member.api_key
                self._strategy_stale = True
            replicas.append(replica)
        for replica in current.values():
            replica.retired = True
            change.retired.append(replica)
            self._strategy_stale = True
        self.replicas = replicas
        self.max_ejections = max_ejections(len(replicas), self.breaker_config.max_ejection_percent)
        if self._strategy_stale:
            self.strategy: BalancingStrategy = make_strategy(self.config, self.replicas)
            self._strategy_stale = False
        return change

    def retire_all(self) -> list[Replica]:
        """The model left the config: every replica drains."""
        for replica in self.replicas:
            replica.retired = True
        retired, self.replicas = self.replicas, []
        return retired

    def _new_replica(self, member: ReplicaConfig, live: bool) -> Replica:
        breaker = CircuitBreaker(self.breaker_config,
                                 on_transition=_bind(self._on_breaker_transition, self.name, member.url),
                                 may_open=self._may_eject)
        return Replica(model=self.name, url=member.url, weight=member.weight, api_key=member.api_key,
                       breaker=breaker, healthy=not live, awaiting_probe=live)

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
        replica in rotation is a candidate again (Envoy's panic threshold), since a pool that judges
        all of its replicas bad is more likely wrong about them than right. Replicas that announced
        a drain, or were added and not yet probed, are never candidates."""
        available = [r for r in self.replicas if r.is_available()]
        if len(available) * 100 < self.panic_threshold_percent * len(self.replicas):
            candidates = [r for r in self.replicas if r not in exclude and r.in_rotation()]
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
    """Model names to pools. `apply` swaps in a new config's models; replicas that leave drain in
    `retiring` until their last attempt ends, then `on_dropped` hears of them."""

    def __init__(self, config: GatewayConfig, on_breaker_transition: BreakerListener | None = None,
                 on_panic: Callable[[str], None] | None = None, *,
                 on_dropped: Callable[[Replica], None] | None = None) -> None:
        self._on_breaker_transition = on_breaker_transition
        self._on_panic = on_panic
        self._on_dropped = on_dropped
        self.pools: list[ModelPool] = []
        self._by_name: dict[str, ModelPool] = {}
        self.retiring: list[Replica] = []
        # Model -> discovery source -> replicas found: kept here, not in the pool, so a source can
        # report before its model's pool exists (a reload resolves new names first).
        self.discovered: dict[str, dict[str, list[ReplicaConfig]]] = {}
        self.apply(config, live=False)

    def apply(self, config: GatewayConfig, *, live: bool = True) -> MembershipChange:
        """Make the pools match `config.models` (runs on the event loop, without awaiting, so no
        request sees half of it)."""
        change = MembershipChange()
        old = {pool.name: pool for pool in self.pools}
        pools = []
        for model in config.models:
            pool = old.pop(model.name, None)
            if pool is None:
                pool = ModelPool(model, config.breaker, self._on_breaker_transition,
                                 panic_threshold_percent=config.health.panic_threshold_percent,
                                 on_panic=self._on_panic, live=live,
                                 discovered=self.discovered.setdefault(model.name, {}))
                change.added.extend(pool.replicas)
                change.models_added.append(model.name)
            else:
                pool.configure(model, config.breaker, panic_threshold_percent=config.health.panic_threshold_percent)
                self._merge(change, pool.sync(live=live))
            pools.append(pool)
        for pool in old.values():
            change.models_removed.append(pool.name)
            self.discovered.pop(pool.name, None)
            self._retire(change, pool.retire_all())
        self.pools = pools
        self._by_name = {name: pool for pool in pools for name in (pool.name, *pool.config.aliases)}
        return change

    def set_discovered(self, model: str, source: str, replicas: list[ReplicaConfig] | None) -> MembershipChange:
        """Apply what a discovery source found for `model` (nothing when the model is gone)."""
        found = self.discovered.setdefault(model, {})
        if replicas is None:
            found.pop(source, None)
        else:
            found[source] = replicas
        change = MembershipChange()
        pool = self._by_name.get(model)
        if pool is None or pool.name != model:
            return change
        self._merge(change, pool.sync(live=True))
        return change

    def _merge(self, change: MembershipChange, pool_change: MembershipChange) -> None:
        change.added.extend(pool_change.added)
        self._retire(change, pool_change.retired)

    def _retire(self, change: MembershipChange, replicas: list[Replica]) -> None:
        for replica in replicas:
            logger.warning("replica %s of %s removed: no new requests; draining %d in flight",
                           replica.url, replica.model, replica.outstanding)
            change.retired.append(replica)
            self.retiring.append(replica)
            replica.on_drained = self._drop
            if replica.outstanding == 0:
                self._drop(replica)

    def _drop(self, replica: Replica) -> None:
        if replica in self.retiring:
            self.retiring.remove(replica)
            logger.warning("replica %s of %s drained and dropped", replica.url, replica.model)
            if self._on_dropped is not None:
                self._on_dropped(replica)

    @traced("route")
    def resolve(self, model: str) -> ModelPool:
        pool = self._by_name.get(model)
        if pool is None:
            raise ModelNotFoundError(
                f"The model {model!r} does not exist on this gateway; GET /v1/models lists the models "
                f"it serves.", param="model")
        return pool

    def all_replicas(self) -> list[Replica]:
        """The replicas of every pool (not the retiring ones)."""
        return [replica for pool in self.pools for replica in pool.replicas]


def _bind(listener: BreakerListener | None, model: str, url: str) -> Callable[[BreakerState], None] | None:
    if listener is None:
        return None
    return lambda state: listener(model, url, state)
