"""In-process LRU cache bounded by entry count, total bytes and a TTL."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from kvik.gateway.cache.backend import CachedResponse, ResponseCache
from kvik.gateway.config import CacheConfig


class MemoryCache(ResponseCache):
    def __init__(self, config: CacheConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, CachedResponse]] = OrderedDict()  # LRU first
        self.total_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, key: str) -> CachedResponse | None:
        item = self._entries.get(key)
        if item is None:
            return None
        expires_at, response = item
        if expires_at <= self._clock():
            self._remove(key)
            return None
        self._entries.move_to_end(key)
        return response

    async def put(self, key: str, response: CachedResponse) -> None:
        if response.size > self._config.max_entry_bytes:
            return
        if key in self._entries:
            self._remove(key)
        self._entries[key] = (self._clock() + self._config.ttl_s, response)
        self.total_bytes += response.size
        while len(self._entries) > self._config.max_entries or self.total_bytes > self._config.max_bytes:
            self._remove(next(iter(self._entries)))

    def _remove(self, key: str) -> None:
        _, response = self._entries.pop(key)
        self.total_bytes -= response.size
