"""Redis counters shared by every gateway on the same `redis_url`.

One Lua script does read, decide and increment atomically on the Redis server, with the server's
clock (gateways' clocks may disagree). Each counter is one hash, `{window index: count}`, so the
script touches a single key (cluster-safe) and old windows are deleted as it goes.
"""

from __future__ import annotations

import logging
from typing import Any

from kvik.gateway.ratelimit.backend import CounterBackend
from kvik.gateway.ratelimit.window import Decision, WindowCounts, decide

logger = logging.getLogger("kvik.gateway.ratelimit")

# KEYS[1]: the counter hash. ARGV: limit, cost, window in ms, mode ("hit", "check" or "add").
# Returns {allowed, current, previous, elapsed fraction}; numbers as strings (Lua truncates floats).
_SCRIPT = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[3])
local index = math.floor(now_ms / window)
local fraction = (now_ms % window) / window
local cur = tonumber(redis.call('HGET', KEYS[1], tostring(index)) or '0')
local prev = tonumber(redis.call('HGET', KEYS[1], tostring(index - 1)) or '0')
local limit, cost, mode = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[4]
local allowed = 1
if mode ~= 'add' and prev * (1 - fraction) + cur + cost > limit then
  allowed = 0
end
if mode == 'add' and cur + cost < 0 then
  cost = -cur  -- a refund never takes the window below zero
end
if allowed == 1 and mode ~= 'check' then
  redis.call('HINCRBY', KEYS[1], tostring(index), cost)
  redis.call('HDEL', KEYS[1], tostring(index - 2))
  redis.call('PEXPIRE', KEYS[1], window * 2)
end
return {allowed, tostring(cur), tostring(prev), tostring(fraction)}
"""


class RedisCounters(CounterBackend):
    def __init__(self, client: Any, *, prefix: str = "kvik:rl:") -> None:
        self._client = client  # a redis.asyncio.Redis, owned (and closed) by the gateway state
        self._prefix = prefix
        self._script = client.register_script(_SCRIPT)

    async def hit(self, name: str, limit: int, cost: int, window_s: float, *, count: bool = True) -> Decision:
        result = await self._run(name, limit, cost, window_s, "hit" if count else "check")
        if result is None:
            return Decision(True)  # Redis unreachable: fail open, serving beats limiting
        allowed, cur, prev, fraction = result
        if allowed:
            return Decision(True)
        return decide(WindowCounts(float(cur), float(prev), float(fraction)), limit, cost, window_s)

    async def add(self, name: str, cost: int, window_s: float) -> None:
        await self._run(name, 0, cost, window_s, "add")

    async def _run(self, name: str, limit: int, cost: int, window_s: float, mode: str) -> list[Any] | None:
        try:
            allowed, cur, prev, fraction = await self._script(
                keys=[self._prefix + name], args=[limit, cost, int(window_s * 1000), mode])
        except Exception as exc:  # redis.RedisError and connection errors alike
            logger.warning("rate limit check skipped, Redis failed: %s", exc)
            return None
        return [int(allowed) == 1, _text(cur), _text(prev), _text(fraction)]



def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
