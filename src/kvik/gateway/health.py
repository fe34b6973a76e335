"""Active health probes: GET each replica's health path on a fixed interval.

A replica is marked down after `unhealthy_after` failed probes in a row and up again after
`healthy_after` good ones. Marking it down also expires the attempts on it that are still waiting
for their first byte, so they fail over to another replica. Passive signals (connect errors and 5xx
on real traffic) go to the replica's circuit breaker instead; the balancer needs both to agree
before it sends traffic.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import httpx

from kvik.gateway.config import HealthConfig
from kvik.gateway.replica import Replica

logger = logging.getLogger("kvik.gateway.health")


class HealthProber:
    def __init__(self, replicas: list[Replica], config: HealthConfig, client: httpx.AsyncClient,
                 on_change: Callable[[Replica], None] | None = None, *, grpc: Any = None) -> None:
        self._replicas = replicas
        self._grpc = grpc  # kvik.gateway.grpc_upstream.GrpcUpstream: probes grpc:// replicas (grpc.health.v1)
        self._config = config
        self._client = client
        self._on_change = on_change
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvik-gateway-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def probe_all(self) -> None:
        # Models may share a replica URL; probe each URL once and apply the result to all of them.
        by_url: dict[str, list[Replica]] = {}
        for replica in self._replicas:
            by_url.setdefault(replica.url, []).append(replica)
        await asyncio.gather(*(self._probe(group) for group in by_url.values()))

    async def _run(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self._config.interval_s)

    async def _probe(self, replicas: list[Replica]) -> None:
        if self._grpc is not None and replicas[0].url.startswith("grpc://"):
            ok = await self._grpc.probe(replicas[0].url, self._config.timeout_s)
            for replica in replicas:
                self._record(replica, ok)
            return
        api_key = replicas[0].api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            response = await self._client.get(replicas[0].url + self._config.path, headers=headers,
                                              timeout=self._config.timeout_s)
            ok = response.status_code == 200
        except httpx.HTTPError:
            ok = False
        for replica in replicas:
            self._record(replica, ok)

    def _record(self, replica: Replica, ok: bool) -> None:
        if ok:
            replica.consecutive_probe_successes += 1
            replica.consecutive_probe_failures = 0
            flip = not replica.healthy and replica.consecutive_probe_successes >= self._config.healthy_after
        else:
            replica.consecutive_probe_failures += 1
            replica.consecutive_probe_successes = 0
            flip = replica.healthy and replica.consecutive_probe_failures >= self._config.unhealthy_after
        if flip:
            replica.healthy = ok
            logger.warning("replica %s of %s is now %s", replica.url, replica.model, "up" if ok else "down")
            if not ok:
                # Requests it has not answered at all yet fail over now (a stopped process never will).
                replica.abandon_waiting()
            if self._on_change is not None:
                self._on_change(replica)
