"""Content hashes for prefix caching: each full KV block is named by a chain hash.

hash(block i) = sha256(hash(block i-1) || token ids of block i || extra keys). Two sequences reach the
same hash only if their whole prefixes up to that block agree, so a lookup by hash finds a block
holding exactly the KV of that prefix. sha256 makes accidental collisions practically impossible;
the cache still checks every hit against the stored token ids as a second guard.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Chain hash of one full block. `extra` separates caches that must not mix (e.g. LoRA ids)."""
    digest = hashlib.sha256()
    digest.update(parent or b"\x00" * 32)
    digest.update(array("q", token_ids).tobytes())
    digest.update(extra)
    return digest.digest()

