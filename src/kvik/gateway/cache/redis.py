"""Redis cache shared by every gateway on the same `redis_url`. Entries expire by TTL; the total size
is Redis's job (set `maxmemory` with an LRU policy), the per-entry bound is ours."""

from __future__ import annotations

import logging
from typing import Any

from kvik.gateway.cache.backend import CachedResponse, ResponseCache
from kvik.gateway.config import CacheConfig

logger = logging.getLogger("kvik.gateway.cache")


class RedisCache(ResponseCache):
    def __init__(self, client: Any, config: CacheConfig, *, prefix: str = "kvik:cache:") -> None:
        self._client = client  # a redis.asyncio.Redis, owned (and closed) by the gateway state
        self._config = config
        self._prefix = prefix

    async def get(self, key: str) -> CachedResponse | None:
        try:
            raw = await self._client.get(self._prefix + key)
        except Exception as exc:  # an unreachable cache is a miss, not an outage
            logger.warning("cache read skipped, Redis failed: %s", exc)
            return None
        return None if raw is None else CachedResponse.from_bytes(raw)

    async def put(self, key: str, response: CachedResponse) -> None:
        if response.size > self._config.max_entry_bytes:
            return
        try:
            await self._client.set(self._prefix + key, response.to_bytes(), px=int(self._config.ttl_s * 1000))
        except Exception as exc:
            logger.warning("cache write skipped, Redis failed: %s", exc)

