"""The local executor: stages in worker processes of this machine, deduplication in this process."""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from kvik.data.config import PipelineConfig
from kvik.data.document import BatchResult, Document, Dropped
from kvik.data.exact_dedup import ExactDuplicateIndex
from kvik.data.executors.base import exact_duplicate, near_duplicate
from kvik.data.minhash import NearDuplicateIndex


class LocalDeduplicator:
    """Both indexes in this process, fed in document order."""

    def __init__(self, config: PipelineConfig) -> None:
        self._exact = ExactDuplicateIndex() if config.exact_dedup.enabled else None
        self._near = NearDuplicateIndex(config.near_dedup) if config.near_dedup.enabled else None

    def check(self, result: BatchResult) -> list[Dropped | None]:
        verdicts: list[Dropped | None] = []
        for doc, digest, hashvalues in zip(result.kept, result.digests, result.signatures):
            earlier = self._exact.add(doc.id, digest) if self._exact else None
            similar = self._near.add(doc.id, hashvalues) if self._near and not earlier else None
            verdicts.append(exact_duplicate(doc, earlier) if earlier
                            else near_duplicate(doc, similar) if similar else None)
        return verdicts


class LocalExecutor:
    def __init__(self, workers: int) -> None:
        self._workers = workers

    def map_batches(self, fn: Callable[[list[Document]], BatchResult],
                    batches: Iterator[list[Document]]) -> Iterator[BatchResult]:
        """At most 2 batches per worker in flight (Pool.imap would read the whole input into its
        task queue)."""
        if self._workers == 1:
            yield from map(fn, batches)
            return
        # spawn, not fork: the parent may hold tokenizer threads, which do not survive a fork.
        with multiprocessing.get_context("spawn").Pool(self._workers) as pool:
            pending: deque[Any] = deque()
            for batch in batches:
                pending.append(pool.apply_async(fn, (batch,)))
                if len(pending) >= 2 * self._workers:
                    yield pending.popleft().get()
            while pending:
                yield pending.popleft().get()

    def deduplicator(self, config: PipelineConfig) -> LocalDeduplicator:
        return LocalDeduplicator(config)

    def close(self) -> None:
        pass
