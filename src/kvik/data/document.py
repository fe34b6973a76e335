"""The records that flow between stages: documents, and the reasons some of them were dropped."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Document:
    id: str  # stable across runs: "<source>#<index>" unless the input gives one
    text: str
    source: str  # the input file it came from


@dataclass(frozen=True, slots=True)
class Dropped:
    """A document a stage removed. `reason` is "<stage>/<rule>", e.g. "gopher_quality/too_few_words"."""

    id: str
    source: str
    reason: str
    text: str
    detail: str = ""  # e.g. the id of the document this one duplicates, or the measured value

    @property
    def stage(self) -> str:
        return self.reason.split("/", 1)[0]


@dataclass(slots=True)
class BatchResult:
    """What the per-batch stages return for one batch, in input order."""

    kept: list[Document] = field(default_factory=list)
    dropped: list[Dropped] = field(default_factory=list)
    # Edits that keep the document, e.g. {"c4/lines_removed": 12, "pii/email": 3}.
    edits: dict[str, int] = field(default_factory=dict)
    # Per kept document (same order as `kept`): MinHash signature (an array of hash values), or None when
    # near-duplicate removal is off.
    signatures: list[object | None] = field(default_factory=list)
    # Per kept document: SHA-256 of its text (`kvik.data.exact_dedup.text_digest`), or None when exact
    # duplicate removal is off.
    digests: list[bytes | None] = field(default_factory=list)

    def count_edit(self, key: str, amount: int = 1) -> None:
        if amount:
            self.edits[key] = self.edits.get(key, 0) + amount
