"""Response cache policy (what is cacheable, the key) and the memory and Redis stores."""

from __future__ import annotations

import asyncio

from kvik.gateway.cache import policy
from kvik.gateway.cache.backend import CachedResponse
from kvik.gateway.cache.memory import MemoryCache
from kvik.gateway.config import CacheConfig

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_only_deterministic_requests_are_cacheable() -> None:
    assert policy.directive({**CHAT, "temperature": 0}, {}).write
    assert policy.directive({**CHAT, "temperature": 0.8, "seed": 7}, {}).write
    assert policy.directive(CHAT, {}) == policy.NO_CACHE  # default temperature 1 samples
    assert policy.directive({**CHAT, "temperature": 0.7}, {}) == policy.NO_CACHE


def test_embeddings_are_cacheable_without_temperature_or_seed() -> None:
    body = {"model": "tiny", "input": ["a", "b"]}
    assert policy.directive(body, {}, sampled=False).write
    assert policy.directive(body, {"x-kvik-cache": "no-store"}, sampled=False) == policy.NO_CACHE


def test_clients_can_opt_out() -> None:
    body = {**CHAT, "temperature": 0}
    assert policy.directive(body, {"x-kvik-cache": "no-store"}) == policy.NO_CACHE
    assert policy.directive(body, {"cache-control": "no-store"}) == policy.NO_CACHE
    assert policy.directive(body, {"cache-control": "no-cache"}) == policy.CacheDirective(read=False, write=True)


def test_key_is_normalised_and_scoped_to_the_tenant() -> None:
    a = policy.cache_key("chat", "m", {"temperature": 0, "messages": [], "model": "alias", "user": "u1"},
                         tenant="key:a")
    b = policy.cache_key("chat", "m", {"model": "m", "messages": [], "temperature": 0}, tenant="key:a")
    assert a == b
    assert a != policy.cache_key("chat", "m", {"model": "m", "messages": [], "temperature": 0, "stream": True},
                                 tenant="key:a")
    assert a != policy.cache_key("completions", "m", {"model": "m", "messages": [], "temperature": 0},
                                 tenant="key:a")
    assert a != policy.cache_key("chat", "m", {"model": "m", "messages": [], "temperature": 0}, tenant="key:b")
    assert a != policy.cache_key("chat", "m", {"model": "m", "messages": [], "temperature": 0}, tenant=None)


def test_key_survives_a_lone_surrogate() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "\ud800"}], "temperature": 0}
    assert len(policy.cache_key("chat", "m", body, tenant=None)) == 64


def entry(size: int) -> CachedResponse:
    return CachedResponse(200, "application/json", (b"x" * size,))


def test_memory_cache_bounds_and_ttl() -> None:
    class Clock:
        now = 0.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    cache = MemoryCache(CacheConfig(ttl_s=10, max_entries=3, max_bytes=250, max_entry_bytes=100), clock=clock)

    async def run() -> None:
        await cache.put("big", entry(101))
        assert await cache.get("big") is None  # over the per-entry bound
        for name in "abc":
            await cache.put(name, entry(80))
        assert len(cache) == 3 and cache.total_bytes == 240
        await cache.get("a")  # a is now most recently used
        await cache.put("d", entry(80))  # over 250 bytes: the least recently used (b) goes
        assert await cache.get("b") is None and await cache.get("a") is not None
        clock.now = 11
        assert await cache.get("a") is None and cache.total_bytes == 160

    asyncio.run(run())


def test_redis_cache_round_trip_and_ttl(redis_server: str) -> None:
    import redis.asyncio as redis_asyncio

    from kvik.gateway.cache.redis import RedisCache

    async def run() -> None:
        client = redis_asyncio.from_url(redis_server)
        cache = RedisCache(client, CacheConfig(ttl_s=0.3, max_entry_bytes=1000), prefix="kvik:test-cache:")
        stream = CachedResponse(200, "text/event-stream", (b"data: 1\n\n", b"data: [DONE]\n\n"))
        await cache.put("k", stream)
        await cache.put("too-big", entry(1001))
        assert await cache.get("k") == stream
        assert await cache.get("too-big") is None
        await asyncio.sleep(0.4)
        assert await cache.get("k") is None
        await client.aclose()

    asyncio.run(run())
