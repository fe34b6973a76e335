"""Exact duplicate removal: the first document with a given normalised text is kept."""

from __future__ import annotations

import hashlib


class ExactDuplicateIndex:
    """Hashes of the documents kept so far (32 bytes each, so it scales to millions in memory)."""

    def __init__(self) -> None:
        self._first: dict[bytes, str] = {}

    def add(self, doc_id: str, text: str) -> str | None:
        """Record `text`; return the id of the earlier identical document, or None if it is new."""
        digest = hashlib.sha256(text.encode("utf-8")).digest()
        earlier = self._first.get(digest)
        if earlier is None:
            self._first[digest] = doc_id
        return earlier
