"""Near-duplicate removal with MinHash LSH (Broder 1997; as in FineWeb and the Pile).

Signatures are computed per document in the workers (a pure function); the index runs in the parent
in document order, so the first of a group of near duplicates is the one kept, whatever the number
of workers. Candidates from the LSH bands are confirmed against the estimated Jaccard similarity
to keep distinct documents that merely share a band.
"""

from __future__ import annotations

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


class NearDuplicateIndex:
    """Documents seen so far; `add` returns the earlier document a new one duplicates, if any."""

    def __init__(self, config: NearDedupConfig) -> None:
        self._config = config
        rows = config.num_perm // config.bands
        self._lsh = MinHashLSH(num_perm=config.num_perm, params=(config.bands, rows))
        # Keyed by insertion number, not by id: input ids are not guaranteed to be unique.
        self._kept: list[tuple[str, LeanMinHash]] = []

    def add(self, doc_id: str, hashvalues: np.ndarray) -> NearDuplicate | None:
        minhash = LeanMinHash(seed=self._config.seed, hashvalues=hashvalues, scheme=SCHEME)
        best: NearDuplicate | None = None
        # Sorted: the LSH returns a set, and the reported duplicate must not depend on set order.
        for key in sorted(self._lsh.query(minhash)):
            other_id, other = self._kept[key]
            similarity = minhash.jaccard(other)
            if similarity >= self._config.threshold and (best is None or similarity > best.similarity):
                best = NearDuplicate(other_id, similarity)
        if best is None:
            self._lsh.insert(len(self._kept), minhash)
            self._kept.append((doc_id, minhash))
        return best
