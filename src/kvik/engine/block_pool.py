"""The pool of KV blocks: reference counts, the free queue, and the prefix-cache index.

Invariants (checked by `check_invariants`, which tests call after every scenario):
- a block is in the free queue if and only if its reference count is 0;
- a block with a hash is in `cached` under that hash, and `cached` holds nothing else;
- free blocks are taken from the front of the queue. Blocks that hold no cached content are put at
  the front when freed (reuse them first); cached ones at the back, so the least recently used
  cached block is the next evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

from kvik.core.hashing import BlockHash


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None  # the content the hash names, to verify hits


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now, cached-but-unreferenced ones included (they can be evicted)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by running sequences (0 for an encoder's empty pool)."""
        return 1.0 - len(self.free_queue) / self.num_blocks if self.num_blocks else 0.0

    def allocate(self, count: int) -> list[KVBlock]:
        if count > len(self.free_queue):
            raise RuntimeError(f"asked for {count} blocks with {len(self.free_queue)} free; "
                               "callers must check num_free_blocks first")
        taken = []
        for _ in range(count):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:  # evict its cached content
                del self.cached[block.block_hash]
                block.block_hash = block.parent_hash = block.token_ids = None
            block.ref_count = 1
            taken.append(block)
        return taken

    def acquire(self, blocks: Iterable[KVBlock]) -> None:
        """Take another reference to blocks found in the prefix cache."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        for block in blocks:
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block.block_id} released twice"
            if block.ref_count == 0:
                self.free_queue[block.block_id] = block
                if block.block_hash is None:
                    self.free_queue.move_to_end(block.block_id, last=False)

    def lookup(self, block_hash: BlockHash, parent_hash: BlockHash | None,
               token_ids: Sequence[int]) -> KVBlock | None:
        """The cached block for this chain position, if its stored content really matches."""
        block = self.cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None
        return block

    def cache(self, block: KVBlock, block_hash: BlockHash, parent_hash: BlockHash | None,
              token_ids: Sequence[int]) -> None:
        """Register a full, computed block. If another block already holds the same content (two
        sequences computed it in the same step), keep the first and leave this one uncached."""
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, tuple(token_ids)
        self.cached[block_hash] = block

    def reset_prefix_cache(self) -> int:
        """Drop every unreferenced cached block; returns how many were dropped."""
        dropped = 0
        for block in list(self.free_queue.values()):
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = block.parent_hash = block.token_ids = None
                self.free_queue.move_to_end(block.block_id, last=False)
                dropped += 1
        return dropped

    def check_invariants(self) -> None:
        for block in self.blocks:
            in_queue = block.block_id in self.free_queue
            assert in_queue == (block.ref_count == 0), f"block {block.block_id}: ref {block.ref_count}"
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block
        assert len(self.cached) == sum(b.block_hash is not None for b in self.blocks)
