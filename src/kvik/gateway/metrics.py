"""Prometheus metrics of one gateway process, on a private registry (several gateways can live in one
test process without clashing). Labels: `model` is the gateway's model name, `replica` the
replica's base URL ("" when no replica was involved: cache hits, rejected requests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from kvik.gateway.breaker import BreakerState
from kvik.gateway.replica import Replica
from kvik.gateway.router import ModelRouter

# The `*_created` timestamp series double the exposition size and no dashboard reads them.
disable_created_metrics()

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvik_gateway_requests", "Requests answered, by final HTTP status.",
                                ["model", "replica", "status"], registry=r)
        self.latency = Histogram("kvik_gateway_request_duration_seconds",
                                 "Time from request received to last byte sent.",
                                 ["model", "replica"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("kvik_gateway_time_to_first_token_seconds",
                              "Streaming requests: time from request received to the first chunk relayed.",
                              ["model", "replica"], buckets=LATENCY_BUCKETS, registry=r)
        self.retries = Counter("kvik_gateway_retries", "Attempts retried on another replica, by reason.",
                               ["model", "reason"], registry=r)
        self.breaker_state = Gauge("kvik_gateway_breaker_state",
                                   "Circuit breaker state per replica: 0 closed, 1 half-open, 2 open.",
                                   ["model", "replica"], registry=r)
        self.breaker_transitions = Counter("kvik_gateway_breaker_transitions",
                                           "Breaker state changes, by the state entered.",
                                           ["model", "replica", "state"], registry=r)
        self.replica_healthy = Gauge("kvik_gateway_replica_healthy",
                                     "1 when the replica's active health probe passes.",
                                     ["model", "replica"], registry=r)
        self.outstanding = Gauge("kvik_gateway_replica_outstanding", "Attempts in flight per replica.",
                                 ["model", "replica"], registry=r)
        self.rate_limited = Counter("kvik_gateway_rate_limited",
                                    "Requests rejected by a per-key limit (rpm, tpm or budget).",
                                    ["limit"], registry=r)
        self.cache = Counter("kvik_gateway_cache_lookups", "Response cache lookups by result (hit, miss).",
                             ["model", "result"], registry=r)
        self.blocked = Counter("kvik_gateway_guardrail_blocks", "Requests blocked by the moderation hook.",
                               ["model"], registry=r)
        self.panic_picks = Counter("kvik_gateway_panic_routing",
                                   "Attempts routed in panic mode (too few replicas available: all tried).",
                                   ["model"], registry=r)

    def on_panic(self, model: str) -> None:
        self.panic_picks.labels(model).inc()

    def on_breaker_transition(self, model: str, replica: str, state: BreakerState) -> None:
        self.breaker_state.labels(model, replica).set(int(state))
        self.breaker_transitions.labels(model, replica, state.name.lower()).inc()

    def forget_replica(self, replica: Replica) -> None:
        """A replica left the config and drained: its per-replica gauges go (counters stay)."""
        for gauge in (self.breaker_state, self.replica_healthy, self.outstanding):
            try:
                gauge.remove(replica.model, replica.url)
            except KeyError:
                pass

    def render(self, router: ModelRouter) -> bytes:
        """The exposition text; per-replica gauges are refreshed first (breakers turn half-open lazily)."""
        for replica in router.all_replicas():
            self.breaker_state.labels(replica.model, replica.url).set(int(replica.breaker.state))
            self.replica_healthy.labels(replica.model, replica.url).set(1 if replica.healthy else 0)
            self.outstanding.labels(replica.model, replica.url).set(replica.outstanding)
        return generate_latest(self.registry)
