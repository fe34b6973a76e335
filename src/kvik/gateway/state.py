"""Everything one gateway process holds, built from the config at start-up and closed at shutdown."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvik.core.errors import ConfigError
from kvik.gateway.auth import Authenticator
from kvik.gateway.cache.backend import ResponseCache
from kvik.gateway.cache.memory import MemoryCache
from kvik.gateway.cache.redis import RedisCache
from kvik.gateway.config import GatewayConfig
from kvik.gateway.guardrails.moderation import ModerationHook
from kvik.gateway.guardrails.pii import PiiRedactor
from kvik.gateway.health import HealthProber
from kvik.gateway.keys import KeyStore
from kvik.gateway.metrics import GatewayMetrics
from kvik.gateway.offload import CpuWorkers
from kvik.gateway.proxy import UpstreamProxy
from kvik.gateway.ratelimit.backend import CounterBackend
from kvik.gateway.ratelimit.limiter import RateLimiter
from kvik.gateway.ratelimit.memory import MemoryCounters
from kvik.gateway.ratelimit.redis import RedisCounters
from kvik.gateway.reload import ConfigReloader
from kvik.gateway.replica import Replica
from kvik.gateway.retry_budget import RetryBudget
from kvik.gateway.router import ModelRouter
from kvik.gateway.storage.database import Database, open_database
from kvik.gateway.scheduling import SchedulingStore
from kvik.gateway.tenancy import CacheSalter
from kvik.gateway.usage import UsageRecorder


@dataclass(slots=True)
class GatewayState:
    config: GatewayConfig
    metrics: GatewayMetrics
    router: ModelRouter
    client: httpx.AsyncClient
    db: Database
    keys: KeyStore
    auth: Authenticator
    limiter: RateLimiter
    cache: ResponseCache | None
    redactor: PiiRedactor | None
    moderation: ModerationHook | None
    usage: UsageRecorder
    prober: HealthProber
    proxy: UpstreamProxy
    redis: Any | None  # redis.asyncio.Redis shared by the limiter and the cache
    cpu: CpuWorkers  # parsing, redaction and encoding of large bodies, off the event loop
    salter: CacheSalter | None  # per-tenant `cache_salt` sent upstream; None when turned off
    scheduling: SchedulingStore  # each key's priority tier and fair-share weight
    grpc: Any | None = None  # kvik.gateway.grpc_upstream.GrpcUpstream: channels to grpc:// replicas
    reloader: ConfigReloader = field(init=False)  # config reloads and service discovery

    @classmethod
    async def start(cls, config: GatewayConfig, config_path: Path | None = None) -> GatewayState:
        """Build everything from `config`; `config_path` is the file reloads read again."""
        metrics = GatewayMetrics()
        grpc = _grpc_upstream(config)

        def dropped(replica: Replica) -> None:
            """A replica that left the configuration finished its last request: forget it."""
            metrics.forget_replica(replica)
            if grpc is not None and replica.url.startswith("grpc://"):
                task = asyncio.ensure_future(grpc.forget(replica.url))  # close its channel
                _closing.add(task)
                task.add_done_callback(_closing.discard)

        router = ModelRouter(config, metrics.on_breaker_transition, metrics.on_panic, on_dropped=dropped)
        redis = await _connect_redis(config.redis_url) if config.redis_url else None
        db = await asyncio.to_thread(open_database, config.database_url)
        keys = KeyStore(db)
        # No pool cap: the replicas, not the gateway, decide how much concurrency they take.
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.timeouts.read_s, connect=config.timeouts.connect_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024),
            follow_redirects=False, trust_env=False)
        counters: CounterBackend = RedisCounters(redis) if redis is not None else MemoryCounters()
        guardrails = config.guardrails
        auth = Authenticator(config.auth, keys)
        # Prefix-cache salts and the tenants' pseudonyms for fair share, under one secret.
        salter = CacheSalter(config.tenancy.cache_salt_secret)
        state = cls(
            config=config, metrics=metrics, router=router, client=client, db=db, keys=keys, auth=auth,
            limiter=RateLimiter(counters, config.limits, metrics),
            cache=_make_cache(config, redis),
            redactor=PiiRedactor(guardrails.pii) if guardrails.pii.enabled else None,
            moderation=ModerationHook(guardrails.moderation) if guardrails.moderation.hook else None,
            usage=UsageRecorder(db, keys, on_persisted=auth.budgets.persisted),
            prober=HealthProber(router.all_replicas, config.health, client, grpc=grpc),
            proxy=UpstreamProxy(client, config.retries.max_attempts, RetryBudget(config.retries), metrics,
                                first_byte_s=config.timeouts.first_byte_s, grpc=grpc),
            redis=redis,
            cpu=CpuWorkers(),
            salter=salter if config.tenancy.cache_salt else None,
            scheduling=SchedulingStore(db, config.scheduling, salter, config.auth.key_cache_ttl_s),
            grpc=grpc,
        )
        state.reloader = ConfigReloader(state, config_path)
        state.usage.start()
        state.prober.start()
        await state.reloader.start()
        return state

    async def close(self) -> None:
        await self.reloader.close()
        await self.prober.stop()
        await self.usage.stop()
        await self.client.aclose()
        if self.grpc is not None:
            await self.grpc.close()
        self.cpu.close()
        if self.redis is not None:
            await self.redis.aclose()
        await asyncio.to_thread(self.db.close)


_closing: set[asyncio.Task[None]] = set()  # channels of dropped grpc:// replicas being closed


def _grpc_upstream(config: GatewayConfig) -> Any | None:
    """Channels to grpc:// replicas; None when grpcio is missing, an error if a replica needs it."""
    try:
        from kvik.gateway.grpc_upstream import GrpcUpstream
    except ImportError:
        if any(r.url.startswith("grpc://") for m in config.models for r in m.replicas):
            raise ConfigError("models: grpc:// replicas need grpcio; pip install 'kvik[grpc]'") from None
        return None
    return GrpcUpstream(config.timeouts.read_s)


def _make_cache(config: GatewayConfig, redis: Any | None) -> ResponseCache | None:
    if not config.cache.enabled:
        return None
    if config.cache.backend == "memory" or redis is None:
        return MemoryCache(config.cache)
    return RedisCache(redis, config.cache)


async def _connect_redis(url: str) -> Any:
    try:
        import redis.asyncio as redis_asyncio
    except ImportError:
        raise ConfigError("redis_url: Redis needs the redis package; pip install 'kvik[gateway]'") from None
    client = redis_asyncio.from_url(url, socket_connect_timeout=5, socket_timeout=5)
    try:
        await client.ping()
    except Exception as exc:
        await client.aclose()
        raise ConfigError(f"redis_url: cannot reach Redis at {url}: {exc}") from None
    return client
