"""Active health probes: GET each replica's health path on a fixed interval.

A replica is marked down after `unhealthy_after` failed probes in a row and up again after
`healthy_after` good ones. Marking it down also expires the attempts on it that are still waiting
for their first byte, so they fail over to another replica. Passive signals (connect errors and 5xx
on real traffic) go to the replica's circuit breaker instead; the balancer needs both to agree
before it sends traffic.

A replica that answers its probe with the drain header (`x-kvik-draining`, sent by `kvik serve`
from the moment it gets SIGTERM) leaves the rotation at once, without counting as a failed probe:
it is finishing its requests, not failing them. A replica added by a reload or by discovery takes
traffic only after a good probe; `probe_now` probes such replicas at once rather than at the next
tick.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from kvik.gateway.config import HealthConfig
from kvik.gateway.replica import DRAIN_HEADER, Replica

logger = logging.getLogger("kvik.gateway.health")


class HealthProber:
    def __init__(self, replicas: Callable[[], Sequence[Replica]], config: HealthConfig, client: httpx.AsyncClient,
                 on_change: Callable[[Replica], None] | None = None, *, grpc: Any = None) -> None:
        self._replicas = replicas  # read at every round: the replica set changes with reloads
        self._grpc = grpc  # kvik.gateway.grpc_upstream.GrpcUpstream: probes grpc:// replicas (grpc.health.v1)
        self.config = config
        self._client = client
        self._on_change = on_change
        self._task: asyncio.Task[None] | None = None
        self._extra: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvik-gateway-health")

    async def stop(self) -> None:
        for task in list(self._extra):
            task.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def probe_all(self) -> None:
        await self.probe(self._replicas())

    async def probe(self, replicas: Sequence[Replica]) -> None:
        # Models may share a replica URL; probe each URL once and apply the result to all of them.
        by_url: dict[str, list[Replica]] = {}
        for replica in replicas:
            by_url.setdefault(replica.url, []).append(replica)
        await asyncio.gather(*(self._probe(group) for group in by_url.values()))

    def probe_now(self, replicas: Sequence[Replica]) -> None:
        """Probe these replicas (just added) now, in the background, instead of at the next round."""
        if replicas and self._task is not None:
            task = asyncio.create_task(self.probe(replicas), name="kvik-gateway-health-new")
            self._extra.add(task)
            task.add_done_callback(self._extra.discard)

    async def _run(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self.config.interval_s)

    async def _probe(self, replicas: list[Replica]) -> None:
        if self._grpc is not None and replicas[0].url.startswith("grpc://"):
            ok = await self._grpc.probe(replicas[0].url, self.config.timeout_s)
            for replica in replicas:
                self._record(replica, ok)
            return
        api_key = replicas[0].api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            response = await self._client.get(replicas[0].url + self.config.path, headers=headers,
                                              timeout=self.config.timeout_s)
            ok = response.status_code == 200
            draining = DRAIN_HEADER in response.headers
        except httpx.HTTPError:
            ok = draining = False
        for replica in replicas:
            if draining:
                replica.announce_drain("its health probe")
            else:
                self._record(replica, ok)

    def _record(self, replica: Replica, ok: bool) -> None:
        if ok and replica.drain_announced:
            # A new process on the same address (a restarted pod keeps its name): serving again.
            replica.drain_announced = False
            logger.warning("replica %s of %s is serving again after a drain", replica.url, replica.model)
        if ok:
            replica.consecutive_probe_successes += 1
            replica.consecutive_probe_failures = 0
            flip = not replica.healthy and replica.consecutive_probe_successes >= self.config.healthy_after
        else:
            replica.consecutive_probe_failures += 1
            replica.consecutive_probe_successes = 0
            flip = replica.healthy and replica.consecutive_probe_failures >= self.config.unhealthy_after
        if flip:
            replica.healthy = ok
            if ok:
                replica.awaiting_probe = False
            logger.warning("replica %s of %s is now %s", replica.url, replica.model, "up" if ok else "down")
            if not ok:
                # Requests it has not answered at all yet fail over now (a stopped process never will).
                replica.abandon_waiting()
            if self._on_change is not None:
                self._on_change(replica)

