"""Exact duplicate removal: the first document with a given normalised text is kept.

Digests are computed per batch by the stages (`text_digest`, in the workers); the index only
compares them, so it can be split by digest across processes or Ray actors and give the same answers
(see `kvik.data.executors`).
"""

from __future__ import annotations

import hashlib


def text_digest(text: str) -> bytes:
    """SHA-256 of the UTF-8 text (32 bytes)."""
    return hashlib.sha256(text.encode("utf-8")).digest()


class ExactDuplicateIndex:
    """Digests of the documents seen so far (32 bytes each, so it scales to millions in memory)."""

    def __init__(self) -> None:
        self._first: dict[bytes, str] = {}

    def add(self, doc_id: str, digest: bytes) -> str | None:
        """Record a document by its `text_digest`; return the id of the earlier document with the same
        text, or None if it is the first."""
        earlier = self._first.get(digest)
        if earlier is None:
            self._first[digest] = doc_id
        return earlier

    def add_many(self, items: list[tuple[str, bytes]]) -> list[str | None]:
        """`add` for (doc_id, digest) pairs in order: one call per batch across a process boundary."""
        return [self.add(doc_id, digest) for doc_id, digest in items]
