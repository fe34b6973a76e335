"""The Ray executor: the per-batch stages as Ray tasks across the cluster, and both deduplication
indexes split across Ray actors: exact duplicates by digest, near duplicates by MinHash LSH band.

This process (the driver) still reads the input, writes the outputs and makes the one decision that
is sequential by definition: which of a document's near-duplicate candidates were themselves kept.
The decision uses the same code as the local executor (`NearDuplicateResolver`), and the band actors
together answer exactly what one table of all the bands would, so the outputs are the same bytes.
Every node needs kvik installed (the same version) for the workers to import the stages.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from kvik.core.errors import ConfigError
from kvik.data.config import PipelineConfig
from kvik.data.document import BatchResult, Document, Dropped
from kvik.data.exact_dedup import ExactDuplicateIndex
from kvik.data.executors.base import exact_duplicate, near_duplicate
from kvik.data.minhash import BandTables, NearDuplicateResolver, band_ranges

try:
    import ray
except ImportError as exc:  # the optional extra
    raise ConfigError("--executor ray needs Ray: pip install 'kvik[ray]'") from exc


def _run_stage(fn: Callable[[list[Document]], BatchResult], batch: list[Document]) -> BatchResult:
    return fn(batch)


class RayDeduplicator:
    """Exact: `ExactDuplicateIndex` actors, a document going to the one its digest picks. Near:
    `BandTables` actors over disjoint band ranges; a document's candidates are the union of their
    answers. Calls for one batch finish before the next batch's, so each actor sees documents in order."""

    def __init__(self, config: PipelineConfig, shards: int) -> None:
        # No CPU reserved: the actors mostly wait, and the stage tasks need every core. SPREAD puts
        # them on different nodes, so the tables' memory is split as well as their work.
        options: dict[str, Any] = {"num_cpus": 0, "scheduling_strategy": "SPREAD"}
        near = config.near_dedup
        self._exact = ([ray.remote(ExactDuplicateIndex).options(**options).remote() for _ in range(shards)]
                       if config.exact_dedup.enabled else [])
        self._bands = ([ray.remote(BandTables).options(**options).remote(near, first, last)
                        for first, last in band_ranges(near.bands, shards)]
                       if near.enabled else [])
        self._resolver = NearDuplicateResolver(near) if near.enabled else None
        self._next_key = 0  # documents offered to near-dedup so far (the local index's arrival number)

    def _exact_earlier(self, result: BatchResult) -> list[str | None]:
        earlier: list[str | None] = [None] * len(result.kept)
        if not self._exact:
            return earlier
        routed: dict[int, list[int]] = {}
        for i, digest in enumerate(result.digests):
            routed.setdefault(int.from_bytes(digest[:8], "little") % len(self._exact), []).append(i)
        calls = {shard: self._exact[shard].add_many.remote([(result.kept[i].id, result.digests[i]) for i in docs])
                 for shard, docs in routed.items()}
        for shard, docs in routed.items():
            for i, found in zip(docs, ray.get(calls[shard])):
                earlier[i] = found
        return earlier

    def check(self, result: BatchResult) -> list[Dropped | None]:
        earlier = self._exact_earlier(result)
        verdicts: list[Dropped | None] = [exact_duplicate(doc, found) if found else None
                                          for doc, found in zip(result.kept, earlier)]
        if self._resolver is None:
            return verdicts
        offered = [i for i, found in enumerate(earlier) if not found]
        items = [(self._next_key + n, result.signatures[i]) for n, i in enumerate(offered)]
        self._next_key += len(items)
        if not items:
            return verdicts
        shared = ray.put(items)  # one copy in the object store for all the band actors
        answers = ray.get([tables.query_insert.remote(shared) for tables in self._bands])
        for n, i in enumerate(offered):
            key, hashvalues = items[n]
            candidates = set().union(*(answer[n] for answer in answers))
            similar = self._resolver.resolve(key, result.kept[i].id, hashvalues, candidates)
            if similar:
                verdicts[i] = near_duplicate(result.kept[i], similar)
        return verdicts

    def close(self) -> None:
        for actor in self._exact + self._bands:
            ray.kill(actor)


class RayExecutor:
    def __init__(self, address: str | None, dedup_shards: int | None) -> None:
        if dedup_shards is not None and dedup_shards < 1:
            raise ConfigError("--dedup-shards: must be at least 1")
        try:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        except ConnectionError as exc:
            raise ConfigError(f"--ray-address: cannot reach a Ray cluster at {address!r} ({exc})") from exc
        self._cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        nodes = sum(1 for node in ray.nodes() if node["Alive"])
        self._shards = dedup_shards or max(1, nodes)
        self._deduplicators: list[RayDeduplicator] = []

    def map_batches(self, fn: Callable[[list[Document]], BatchResult],
                    batches: Iterator[list[Document]]) -> Iterator[BatchResult]:
        """Two tasks per cluster CPU in flight at most: the input is read only as far as needed."""
        stage = ray.remote(_run_stage)
        fn_ref = ray.put(fn)  # the config travels once, not with every task
        pending: deque[Any] = deque()
        for batch in batches:
            pending.append(stage.remote(fn_ref, batch))
            if len(pending) >= 2 * self._cpus:
                yield ray.get(pending.popleft())
        while pending:
            yield ray.get(pending.popleft())

    def deduplicator(self, config: PipelineConfig) -> RayDeduplicator:
        deduplicator = RayDeduplicator(config, self._shards)
        self._deduplicators.append(deduplicator)
        return deduplicator

    def close(self) -> None:
        for deduplicator in self._deduplicators:
            deduplicator.close()
        ray.shutdown()  # disconnects this driver; a cluster it joined keeps running
