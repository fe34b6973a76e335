"""Prometheus metrics in vLLM's naming style with a `kvik:` prefix.

Per-request latencies are observed by the server as outputs reach it (what a client experiences);
engine gauges and token counters are read from the engine's stats snapshot at scrape time. Each app
has its own registry, so several servers in one process (tests) do not collide.

Queue time, time to first token and tokens served carry a `tier` label (the priority tier's name,
`kvik.core.tiers`; "other" for a priority no tier has), and so do preemptions and waiting sequences,
which the engine counts per priority. With several models, each loaded model has its own series.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvik.core.tiers import DEFAULT_TIERS, tier_name
from kvik.engine.messages import EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], Iterable[tuple[str, EngineStats]]], tiers: dict[str, int]) -> None:
        self.stats = stats
        self.tiers = tiers

    def collect(self) -> Iterator[Metric]:
        snapshots = list(self.stats())
        if not snapshots:
            return
        labels = ["model_name"]

        def gauge(name: str, doc: str, value: Callable[[EngineStats], float]) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"kvik:{name}", doc, labels=labels)
            for model, stats in snapshots:
                family.add_metric([model], value(stats))
            return family

        def counter(name: str, doc: str, value: Callable[[EngineStats], float]) -> CounterMetricFamily:
            family = CounterMetricFamily(f"kvik:{name}", doc, labels=labels)
            for model, stats in snapshots:
                family.add_metric([model], value(stats))
            return family

        yield gauge("num_requests_running", "Sequences in the running batch.", lambda s: s.num_running)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.", lambda s: s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", lambda s: s.kv_cache_usage)
        yield gauge("kv_cache_free_blocks", "KV blocks free or holding evictable cached prefixes.",
                    lambda s: s.num_free_blocks)
        yield gauge("kv_cache_total_blocks", "KV blocks in the pool.", lambda s: s.num_blocks)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      lambda s: s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      lambda s: s.prefix_cache_hits)
        yield counter("prompt_tokens", "Prompt tokens admitted.", lambda s: s.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", lambda s: s.generation_tokens)
        yield counter("num_preemptions", "Sequences preempted for lack of KV blocks.",
                      lambda s: s.num_preemptions)
        preempted = CounterMetricFamily("kvik:tier_preemptions", "Sequences preempted, by priority tier "
                                        "(for blocks: freed and recomputed; or out of the batch for a "
                                        "better tier, KV kept).",
                                        labels=["model_name", "tier"])
        waiting = GaugeMetricFamily("kvik:tier_requests_waiting", "Sequences waiting, by priority tier.",
                                    labels=["model_name", "tier"])
        for model, stats in snapshots:
            for family, by_priority in ((preempted, stats.preemptions_by_priority),
                                        (waiting, stats.waiting_by_priority)):
                for tier, value in self._by_tier(by_priority).items():
                    family.add_metric([model, tier], value)
        yield preempted
        yield waiting
        yield counter("spec_decode_num_drafts", "Speculative verifications (steps of one sequence "
                      "with at least one draft token).", lambda s: s.spec_decode_num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                      lambda s: s.spec_decode_num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens the target accepted.",
                      lambda s: s.spec_decode_num_accepted_tokens)
        per_position = CounterMetricFamily("kvik:spec_decode_num_accepted_tokens_per_pos",
                                           "Draft tokens accepted, by position in the draft (0 = first).",
                                           labels=["model_name", "position"])
        for model, stats in snapshots:
            for position, value in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                per_position.add_metric([model, str(position)], value)
        yield per_position
        yield gauge("lora_adapters", "LoRA adapters the engine serves (--enable-lora).", lambda s: s.lora_adapters)
        yield gauge("lora_adapters_in_slots", "LoRA adapters in device-memory slots now (at most --max-loras).",
                    lambda s: s.lora_adapters_in_slots)
        yield counter("lora_slot_loads", "LoRA adapters copied into a slot (slot cache misses).",
                      lambda s: s.lora_slot_loads)
        yield counter("lora_disk_loads", "LoRA adapters read from their directory again (CPU cache misses).",
                      lambda s: s.lora_disk_loads)

    def _by_tier(self, by_priority: dict[int, int]) -> dict[str, int]:
        totals = {name: 0 for name in self.tiers}
        for priority, value in by_priority.items():
            name = tier_name(priority, self.tiers)
            totals[name] = totals.get(name, 0) + value
        return totals


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], Iterable[tuple[str, EngineStats]]],
                 tiers: dict[str, int] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name  # the default model: label of what is not about one model
        self.tiers = tiers or dict(DEFAULT_TIERS)
        labels, tiered = ["model_name"], ["model_name", "tier"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...], names: list[str]) -> Histogram:
            return Histogram(f"kvik:{name}", doc, names, buckets=buckets, registry=self.registry)

        self._ttft = histogram("time_to_first_token_seconds", "Arrival to first output token.",
                               LATENCY_BUCKETS, tiered)
        self._inter_token = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.",
                                      TOKEN_BUCKETS, labels)
        self._e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", LATENCY_BUCKETS, tiered)
        self._queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled in the engine.",
                                     LATENCY_BUCKETS, tiered)
        self._tokens = Counter("kvik:tier_tokens", "Tokens served, by priority tier and kind "
                               "(prompt or generation).", ["model_name", "tier", "kind"], registry=self.registry)
        self._success = Counter("kvik:request_success", "Finished choices by finish reason.",
                                ["model_name", "finish_reason"], registry=self.registry)
        self._rejected = Counter("kvik:request_rejected", "Requests refused before reaching the engine.",
                                 ["model_name", "reason"], registry=self.registry)
        self.registry.register(_EngineCollector(stats, self.tiers))
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def tier(self, priority: int) -> str:
        return tier_name(priority, self.tiers)

    def _child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, remembered: streams observe per token, and prometheus_client's
        `labels()` costs as much again as the observation."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def time_to_first_token(self, model: str, tier: str, seconds: float) -> None:
        self._child(self._ttft, model, tier).observe(seconds)

    def inter_token_latency(self, model: str, seconds: float) -> None:
        self._child(self._inter_token, model).observe(seconds)

    def e2e_latency(self, model: str, tier: str, seconds: float) -> None:
        self._child(self._e2e, model, tier).observe(seconds)

    def queue_time(self, model: str, tier: str, seconds: float) -> None:
        self._child(self._queue_time, model, tier).observe(seconds)

    def tokens(self, model: str, tier: str, prompt: int, generation: int) -> None:
        if prompt:
            self._child(self._tokens, model, tier, "prompt").inc(prompt)
        if generation:
            self._child(self._tokens, model, tier, "generation").inc(generation)

    def finished(self, finish_reason: str, model: str | None = None) -> None:
        self._child(self._success, model or self.model_name, finish_reason).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
