"""Prometheus metrics in vLLM's naming style with a `kvik:` prefix.

Per-request latencies are observed by the server as outputs reach it (what a client experiences);
engine gauges and token counters are read from the engine's stats snapshot at scrape time. Each app
has its own registry, so several servers in one process (tests) do not collide.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvik.engine.messages import EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None], model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        if stats is None:
            return
        labels = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"kvik:{name}", doc, labels=labels)
            family.add_metric([self.model_name], value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"kvik:{name}", doc, labels=labels)
            family.add_metric([self.model_name], value)
            return family

        yield gauge("num_requests_running", "Sequences in the running batch.", stats.num_running)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.", stats.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", stats.kv_cache_usage)
        yield gauge("kv_cache_free_blocks", "KV blocks free or holding evictable cached prefixes.",
                    stats.num_free_blocks)
        yield gauge("kv_cache_total_blocks", "KV blocks in the pool.", stats.num_blocks)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      stats.prefix_cache_hits)
        yield counter("prompt_tokens", "Prompt tokens admitted.", stats.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens)
        yield counter("num_preemptions", "Sequences preempted for lack of KV blocks.",
                      stats.num_preemptions)
        yield counter("spec_decode_num_drafts", "Speculative verifications (steps of one sequence "
                      "with at least one draft token).", stats.spec_decode_num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                      stats.spec_decode_num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens the target accepted.",
                      stats.spec_decode_num_accepted_tokens)
        per_position = CounterMetricFamily("kvik:spec_decode_num_accepted_tokens_per_pos",
                                           "Draft tokens accepted, by position in the draft (0 = first).",
                                           labels=["model_name", "position"])
        for position, value in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            per_position.add_metric([self.model_name, str(position)], value)
        yield per_position


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"kvik:{name}", doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Arrival to first output token.", LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Time between consecutive output tokens.", TOKEN_BUCKETS)
        self.e2e_latency = histogram("e2e_request_latency_seconds", "Arrival to last token.",
                                     LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Arrival to first scheduled in the engine.", LATENCY_BUCKETS)
        self._success = Counter("kvik:request_success", "Finished choices by finish reason.",
                                ["model_name", "finish_reason"], registry=self.registry)
        self._rejected = Counter("kvik:request_rejected", "Requests refused before reaching the engine.",
                                 ["model_name", "reason"], registry=self.registry)
        self.registry.register(_EngineCollector(stats, model_name))

    def finished(self, finish_reason: str) -> None:
        self._success.labels(self.model_name, finish_reason).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
