"""The executor interface: map the per-batch stages over batches in order, and deduplicate the
kept documents of each batch, in document order, against everything before them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from kvik.data.config import PipelineConfig
from kvik.data.document import BatchResult, Document, Dropped
from kvik.data.minhash import NearDuplicate


class Deduplicator(Protocol):
    def check(self, result: BatchResult) -> list[Dropped | None]:
        """For each kept document of `result`, in order: its `Dropped` record when it duplicates an
        earlier document (exact first, then near), else None. Batches must arrive in input order."""


class Executor(Protocol):
    def map_batches(self, fn: Callable[[list[Document]], BatchResult],
                    batches: Iterator[list[Document]]) -> Iterator[BatchResult]:
        """`fn` over `batches`, results in input order, reading the input lazily."""

    def deduplicator(self, config: PipelineConfig) -> Deduplicator:
        """A fresh deduplicator for one run of `config` (exact and near as the config enables)."""

    def close(self) -> None:
        """Release workers, actors and connections."""


def exact_duplicate(doc: Document, earlier_id: str) -> Dropped:
    return Dropped(doc.id, doc.source, "exact_dedup/duplicate", doc.text, f"same text as {earlier_id}")


def near_duplicate(doc: Document, similar: NearDuplicate) -> Dropped:
    return Dropped(doc.id, doc.source, "near_dedup/near_duplicate", doc.text,
                   f"jaccard {similar.similarity:.2f} with {similar.of}")
