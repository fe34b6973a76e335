"""Per-sequence block tables over the block pool, and automatic prefix caching.

A full block is registered in the prefix cache only after its KV has been computed (at the end of the
step that filled it), so a hit can never point at a block whose KV is still to be written, even if
the sequence that allocated it is preempted in the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvik.core.hashing import BlockHash, hash_block
from kvik.engine.block_pool import BlockPool, KVBlock
from kvik.engine.request import Request


@dataclass(slots=True)
class PrefixHit:
    blocks: list[KVBlock] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[KVBlock]] = {}
        # The same tables as block ids, kept in step, for the model runner (no per-step rebuild).
        self.block_id_tables: dict[str, list[int]] = {}
        # Chain hashes of each sequence's leading full blocks that are registered (or were hits).
        self.block_hashes: dict[str, list[BlockHash]] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    # -- prefix cache --

    def find_cached_prefix(self, request: Request) -> PrefixHit:
        """The longest chain of cached full blocks matching the sequence's tokens. At least one token
        is always left to compute, because the step must produce logits for the next token."""
        hit = PrefixHit()
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return hit
        tokens, size = request.all_token_ids, self.block_size
        parent: BlockHash | None = None
        for index in range((request.num_tokens - 1) // size):
            block_tokens = tokens[index * size:(index + 1) * size]
            block_hash = hash_block(parent, block_tokens, request.block_hash_extra(index, size))
            block = self.pool.lookup(block_hash, parent, block_tokens)
            if block is None:
                break
            hit.blocks.append(block)
            hit.hashes.append(block_hash)
            parent = block_hash
        return hit

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the sequence's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(request.seq_id)
        if not table:
            return
        hashes = self.block_hashes.setdefault(request.seq_id, [])
        size, tokens = self.block_size, request.all_token_ids
        num_full = min(request.num_computed_tokens // size, len(table))
        for index in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else None
            block_tokens = tokens[index * size:(index + 1) * size]
            block_hash = hash_block(parent, block_tokens, request.block_hash_extra(index, size))
            self.pool.cache(table[index], block_hash, parent, block_tokens)
            hashes.append(block_hash)

    # -- allocation --

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       hit: PrefixHit | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (plus the prefix hit
        when admitting a waiting sequence). Allocates only if everything fits; False otherwise."""
        table = self.block_tables.get(request.seq_id, [])
        hit_blocks = hit.blocks if hit else []
        computed = request.num_computed_tokens + len(hit_blocks) * self.block_size
        needed = -(-(computed + num_new_tokens) // self.block_size) - len(table) - len(hit_blocks)
        # Hit blocks nobody references sit in the free queue; taking them shrinks what is free.
        reclaimed = sum(1 for block in hit_blocks if block.ref_count == 0)
        if needed > self.pool.num_free_blocks - reclaimed:
            return False
        ids = self.block_id_tables.setdefault(request.seq_id, [])
        if hit_blocks:
            self.pool.acquire(hit_blocks)
            table = table + hit_blocks
            ids.extend(block.block_id for block in hit_blocks)
            self.block_hashes[request.seq_id] = list(hit.hashes)
        if needed > 0:
            new_blocks = self.pool.allocate(needed)
            table = table + new_blocks
            ids.extend(block.block_id for block in new_blocks)
        self.block_tables[request.seq_id] = table
        return True

    def free(self, request: Request) -> None:
        """Return the sequence's blocks. Tail first, so a chain's deepest blocks are evicted before
        the prefixes other sequences are more likely to share."""
        table = self.block_tables.pop(request.seq_id, None)
        self.block_id_tables.pop(request.seq_id, None)
        self.block_hashes.pop(request.seq_id, None)
        if table:
            self.pool.release(reversed(table))

    def block_ids(self, request: Request) -> list[int]:
        """The sequence's block table as ids (the manager's own list: do not modify)."""
        return self.block_id_tables.get(request.seq_id, [])

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks
