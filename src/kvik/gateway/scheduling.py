"""Priority tiers and fair-share weights of API keys, and what the gateway tells the server.

Every key is in a tier (`scheduling.tiers` in the config: name -> priority; keys without one are in
`scheduling.default_tier`) and has a weight for fair share within its tier (1 = an equal share). On
every proxied request the gateway removes the client's `priority`, `tenant` and `tenant_weight` and
sets its own: the key's tier priority, the tenant and the key's weight. The tenant is
`kvik.gateway.tenancy.tenant_of` (the key's team, else the key, so a team does not multiply its
share by making keys) under a pseudonym (`CacheSalter.pseudonym`, keyed by
`tenancy.cache_salt_secret`), so replicas never see key ids or team names. A client can neither raise
its own priority nor pose as another tenant; the server trusts those fields from the gateway, which
holds its API key. Batch files and batches are owned by the key id itself (`batch_owner`): ownership
must survive a gateway restart, which a per-process random secret would not.

Stored in `key_scheduling` (migration 5), read through a short cache like the keys themselves.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from kvik.core.errors import InvalidRequestError
from kvik.gateway.auth import Principal
from kvik.gateway.config import SchedulingConfig
from kvik.gateway.storage.database import Database
from kvik.gateway.tenancy import ANONYMOUS_TENANT, CacheSalter, tenant_of

MAX_WEIGHT = 1000.0
# What a client may not set itself on a proxied request.
SCHEDULING_FIELDS = ("priority", "tenant", "tenant_weight")


@dataclass(slots=True, frozen=True)
class KeyScheduling:
    tier: str
    weight: float = 1.0

    def to_public_dict(self, priority: int) -> dict[str, Any]:
        return {"tier": self.tier, "weight": self.weight, "priority": priority}


class SchedulingStore:
    def __init__(self, db: Database, config: SchedulingConfig, pseudonyms: CacheSalter,
                 cache_ttl_s: float = 5.0) -> None:
        self._db = db
        self.config = config
        self._pseudonyms = pseudonyms
        self._ttl = cache_ttl_s
        self._cache: dict[str, tuple[float, KeyScheduling]] = {}

    def default(self) -> KeyScheduling:
        return KeyScheduling(self.config.default_tier)

    def get(self, key_id: str) -> KeyScheduling:
        row = self._db.fetchone("SELECT tier, weight FROM key_scheduling WHERE key_id = ?", (key_id,))
        if row is None or row["tier"] not in self.config.tiers:  # a tier removed from the config
            return self.default()
        return KeyScheduling(row["tier"], float(row["weight"]))

    def set(self, key_id: str, tier: str, weight: float) -> KeyScheduling:
        if tier not in self.config.tiers:
            raise InvalidRequestError(f"tier: {tier!r} is not one of {', '.join(self.config.tiers)}", param="tier")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= MAX_WEIGHT:
            raise InvalidRequestError(f"weight: give a number in (0, {MAX_WEIGHT:g}]", param="weight")
        with self._db.transaction():
            self._db.execute("DELETE FROM key_scheduling WHERE key_id = ?", (key_id,))
            self._db.execute("INSERT INTO key_scheduling (key_id, tier, weight, updated_at) VALUES (?, ?, ?, ?)",
                             (key_id, tier, float(weight), time.time()))
        self._cache.pop(key_id, None)
        return KeyScheduling(tier, float(weight))

    async def lookup(self, key_id: str) -> KeyScheduling:
        now = time.monotonic()
        cached = self._cache.get(key_id)
        if cached is not None and cached[0] > now:
            return cached[1]
        found = await asyncio.to_thread(self.get, key_id)
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[key_id] = (now + self._ttl, found)
        return found

    async def request_fields(self, principal: Principal) -> dict[str, Any]:
        """The scheduling fields of a proxied request body, from the caller's key (none when
        `scheduling.send_fields` is off; the client's own are removed either way)."""
        if not self.config.send_fields:
            return {}
        scheduling = await self.of(principal)
        return {"priority": self.config.tiers[scheduling.tier], "tenant": self._pseudonyms.pseudonym(tenant_of(principal)),
                "tenant_weight": scheduling.weight}

    async def of(self, principal: Principal) -> KeyScheduling:
        key_id = principal.key_id
        return self.default() if key_id is None else await self.lookup(key_id)

    @staticmethod
    def batch_owner(principal: Principal) -> str:
        """Whose files and batches these are on the batch server: each key sees only its own."""
        return principal.key_id or ANONYMOUS_TENANT
