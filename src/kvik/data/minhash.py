"""Near-duplicate removal with MinHash LSH (Broder 1997; as in FineWeb and the Pile).

Signatures are computed per document in the workers (a pure function); the index runs in document
order, so the first of a group of near duplicates is the one kept, whatever the number of workers.
Candidates from the LSH bands are confirmed against the estimated Jaccard similarity to keep distinct
documents that merely share a band.

The work splits in two halves, so that the LSH tables can be sharded by band across Ray actors
(`kvik.data.executors.ray_cluster`) and still give the local answers: `BandTables` finds the earlier
documents that share a band with a new one (any subset of the bands), and `NearDuplicateResolver`
decides, in document order, which candidate (if any) the new document duplicates.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from datasketch import LeanMinHash, MinHash, MinHashLSH

from kvik.data.config import NearDedupConfig
from kvik.data.words import split_words

# datasketch's default permutation scheme, named: signatures cross a process boundary as bare
# hash values, which carry no trace of the scheme that produced them.
SCHEME = "affine32"


def shingles(text: str, size: int) -> set[bytes]:
    """Word n-grams of lower-cased words; a text shorter than `size` words is one shingle."""
    words = [w.lower() for w in split_words(text)]
    if len(words) <= size:
        return {" ".join(words).encode()}
    return {" ".join(words[i:i + size]).encode() for i in range(len(words) - size + 1)}


def signature(text: str, config: NearDedupConfig) -> np.ndarray:
    """The MinHash signature of `text`: `num_perm` hash values."""
    minhash = MinHash(num_perm=config.num_perm, seed=config.seed, scheme=SCHEME)
    minhash.update_batch(sorted(shingles(text, config.shingle_size)))
    return minhash.hashvalues


@dataclass(frozen=True, slots=True)
class NearDuplicate:
    of: str  # id of the earlier document it duplicates
    similarity: float  # estimated Jaccard similarity


def band_ranges(bands: int, shards: int) -> list[tuple[int, int]]:
    """[first, last) band ranges of `shards` near-equal contiguous parts, each of at least two bands
    (datasketch's LSH needs two), so fewer parts when `bands` < 2 x `shards`."""
    shards = max(1, min(shards, bands // 2))
    return [(i * bands // shards, (i + 1) * bands // shards) for i in range(shards)]


class BandTables:
    """The LSH tables of bands [first_band, last_band) of the signature: which earlier documents
    share at least one of these bands with a new one. The union over a partition of the bands is what
    one table of all the bands answers."""

    def __init__(self, config: NearDedupConfig, first_band: int = 0, last_band: int | None = None) -> None:
        last_band = config.bands if last_band is None else last_band
        if not 0 <= first_band < last_band <= config.bands:
            raise ValueError(f"bands [{first_band}, {last_band}) are not within [0, {config.bands})")
        rows = config.num_perm // config.bands
        self._seed = config.seed
        self._start, self._end = first_band * rows, last_band * rows  # hash values these bands cover
        self._lsh = MinHashLSH(num_perm=self._end - self._start, params=(last_band - first_band, rows))

    def _minhash(self, hashvalues: np.ndarray) -> LeanMinHash:
        return LeanMinHash(seed=self._seed, hashvalues=hashvalues[self._start:self._end], scheme=SCHEME)

    def candidates(self, hashvalues: np.ndarray) -> list[int]:
        """Keys of the inserted documents sharing a band with `hashvalues` (a full signature), sorted."""
        return sorted(self._lsh.query(self._minhash(hashvalues)))

    def insert(self, key: int, hashvalues: np.ndarray) -> None:
        self._lsh.insert(key, self._minhash(hashvalues))

    def query_insert(self, items: list[tuple[int, np.ndarray]]) -> list[list[int]]:
        """For (key, signature) pairs in document order: each one's candidates among the documents
        inserted before it (this batch's earlier ones included), then insert it."""
        found = []
        for key, hashvalues in items:
            found.append(self.candidates(hashvalues))
            self.insert(key, hashvalues)
        return found


class NearDuplicateResolver:
    """The decision, in document order: a document duplicates the kept candidate with the highest
    estimated Jaccard similarity at or above the threshold (the earliest on a tie); documents that
    duplicate nothing are kept and become candidates for later ones."""

    def __init__(self, config: NearDedupConfig) -> None:
        self._config = config
        self._kept: dict[int, tuple[str, LeanMinHash]] = {}  # key -> (doc id, signature)

    def resolve(self, key: int, doc_id: str, hashvalues: np.ndarray,
                candidates: Iterable[int]) -> NearDuplicate | None:
        """`candidates`: keys (in document order) sharing a band with this document; those that were
        not kept themselves are skipped. Returns the duplicate found, or None (then it is kept)."""
        minhash = LeanMinHash(seed=self._config.seed, hashvalues=hashvalues, scheme=SCHEME)
        best: NearDuplicate | None = None
        for other_key in sorted(candidates):
            kept = self._kept.get(other_key)
            if kept is None:
                continue
            similarity = minhash.jaccard(kept[1])
            if similarity >= self._config.threshold and (best is None or similarity > best.similarity):
                best = NearDuplicate(kept[0], similarity)
        if best is None:
            self._kept[key] = (doc_id, minhash)
        return best


class NearDuplicateIndex:
    """Documents seen so far, in one process; `add` returns the earlier document a new one
    duplicates, if any. Only kept documents enter the tables."""

    def __init__(self, config: NearDedupConfig) -> None:
        self._tables = BandTables(config)
        self._resolver = NearDuplicateResolver(config)
        # Keyed by arrival number, not by id: input ids are not guaranteed to be unique.
        self._count = 0

    def add(self, doc_id: str, hashvalues: np.ndarray) -> NearDuplicate | None:
        key = self._count
        self._count += 1
        best = self._resolver.resolve(key, doc_id, hashvalues, self._tables.candidates(hashvalues))
        if best is None:
            self._tables.insert(key, hashvalues)
        return best
