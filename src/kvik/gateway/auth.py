"""Who is calling: bearer keys to `Principal`s, with a short per-process cache in front of the
database so the hot path does not query it on every request; and each key's lifetime token budget.

Budgets are reserved at admission and settled at the end, like TPM (see `BudgetLedger`)."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Mapping
from dataclasses import dataclass

from kvik.core.errors import AuthenticationError, PermissionDeniedError, QuotaExceededError
from kvik.core.tracing import traced
from kvik.gateway.config import AuthConfig
from kvik.gateway.keys import ApiKey, KeyStore, hash_secret
from kvik.gateway.tokens import TokenEstimate

BOOTSTRAP_ADMIN_ID = "bootstrap-admin"
_MAX_CACHED_KEYS = 10_000


@dataclass(slots=True, frozen=True)
class Principal:
    """The caller. `key` is None only when auth is disabled (anonymous, no per-key limits)."""

    key: ApiKey | None

    @property
    def key_id(self) -> str | None:
        return None if self.key is None else self.key.id


ANONYMOUS = Principal(key=None)


class Authenticator:
    def __init__(self, config: AuthConfig, keys: KeyStore) -> None:
        self._keys = keys
        self._cache: dict[str, tuple[float, ApiKey]] = {}  # sha256 -> (expiry, key)
        self.budgets = BudgetLedger()
        self.reconfigure(config)

    def reconfigure(self, config: AuthConfig) -> None:
        """Take a reloaded `auth` section: a new admin key is accepted (and the old one refused) at
        once; cached keys are looked up again. Budgets in flight are kept."""
        self._config = config
        self._cache.clear()
        self._bootstrap = None if config.admin_key is None else ApiKey(
            id=BOOTSTRAP_ADMIN_ID, name="auth.admin_key", key_prefix=config.admin_key[:12], role="admin",
            models=None, rpm=None, tpm=None, token_budget=None, tokens_used=0, created_at=0.0)

    @traced("auth")
    async def authenticate(self, authorization: str | None) -> Principal:
        """The caller of a model endpoint; raises 401 for a missing or unknown key."""
        if not self._config.enabled:
            return ANONYMOUS
        return Principal(await self._key_for(authorization))

    async def authenticate_admin(self, authorization: str | None) -> Principal:
        """The caller of an admin endpoint: always needs an admin key, even with auth disabled."""
        key = await self._key_for(authorization)
        if not key.is_admin:
            raise PermissionDeniedError("This endpoint needs a key with the admin role.")
        return Principal(key)

    @staticmethod
    def authorize_model(principal: Principal, model: str) -> None:
        if principal.key is not None and not principal.key.allows_model(model):
            raise PermissionDeniedError(f"This API key may not use the model {model!r}.", param="model",
                                        code="model_not_allowed")

    def forget(self, key_id: str) -> None:
        """Drop a key from the cache (after a revoke on this instance)."""
        for digest, (_, key) in list(self._cache.items()):
            if key.id == key_id:
                del self._cache[digest]

    async def _key_for(self, authorization: str | None) -> ApiKey:
        secret = _bearer(authorization)
        admin_key = self._config.admin_key
        if self._bootstrap is not None and admin_key and hmac.compare_digest(secret.encode(), admin_key.encode()):
            return self._bootstrap
        digest = hash_secret(secret)
        now = time.monotonic()
        cached = self._cache.get(digest)
        if cached is not None and cached[0] > now:
            return cached[1]
        flushed = self.budgets.flushed_so_far()  # before the read: see BudgetLedger.observe
        key = await asyncio.to_thread(self._keys.lookup, secret)
        if key is None:
            self._cache.pop(digest, None)
            raise AuthenticationError("Incorrect API key provided. Create one with `kvik gateway keys create`.")
        self.budgets.observe(key, flushed)
        if len(self._cache) >= _MAX_CACHED_KEYS:
            self._cache.clear()
        self._cache[digest] = (now + self._config.key_cache_ttl_s, key)
        return key


def _bearer(authorization: str | None) -> str:
    if not authorization:
        raise AuthenticationError("You didn't provide an API key. Send it as `Authorization: Bearer KEY`.")
    scheme, _, secret = authorization.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise AuthenticationError("Malformed Authorization header; expected `Bearer KEY`.")
    return secret.strip()


class BudgetLedger:
    """Lifetime token budgets as this process sees them.

    A key's `tokens_used` in the database lags what this process charged by one usage flush, and a
    cached key lags the database by one refresh. So the ledger counts what it charged since start
    and what of that it flushed, and takes from each database read only the baseline: the read's
    `tokens_used` minus what this process had flushed before the read began. Used = baseline +
    charged here. A flush that lands between the snapshot and the read is counted twice until the
    next read (an over-count, never an under-count). Requests in flight hold reservations.
    """

    def __init__(self) -> None:
        self._charged: dict[str, int] = {}  # key id -> tokens charged by this process since start
        # key id -> of those, written to the database; replaced on each flush, never mutated, so a
        # reference taken before a read is a consistent snapshot.
        self._flushed: Mapping[str, int] = {}
        self._baseline: dict[str, int] = {}  # key id -> database tokens_used minus our flushed share
        self._reserved: dict[str, int] = {}  # key id -> tokens held by requests in flight

    def flushed_so_far(self) -> Mapping[str, int]:
        return self._flushed

    def observe(self, key: ApiKey, flushed_before_read: Mapping[str, int]) -> None:
        self._baseline[key.id] = key.tokens_used - flushed_before_read.get(key.id, 0)

    def persisted(self, totals: Mapping[str, int]) -> None:
        """The usage recorder wrote these tokens into the keys' `tokens_used`."""
        flushed = dict(self._flushed)
        for key_id, tokens in totals.items():
            flushed[key_id] = flushed.get(key_id, 0) + tokens
        self._flushed = flushed

    def used(self, key: ApiKey) -> int:
        baseline = self._baseline.get(key.id, key.tokens_used - self._flushed.get(key.id, 0))
        return baseline + self._charged.get(key.id, 0)

    def reserve(self, principal: Principal, estimate: TokenEstimate) -> int:
        """Hold tokens of the key's budget for one request (0 when it has none), or raise 429
        `insufficient_quota` when what is left cannot cover it."""
        key = principal.key
        if key is None or key.token_budget is None:
            return 0
        left = key.token_budget - self.used(key) - self._reserved.get(key.id, 0)
        if left <= 0:
            raise QuotaExceededError(f"This API key has used its budget of {key.token_budget} tokens.")
        if estimate.explicit and estimate.completion > left:
            raise QuotaExceededError(
                f"This API key has {left} tokens of its budget left (some may be held by requests in "
                f"flight), and this request may generate {estimate.completion}; lower max_tokens.")
        held = min(estimate.total, left)
        self._reserved[key.id] = self._reserved.get(key.id, 0) + held
        return held

    def settle(self, principal: Principal, held: int, used: int) -> None:
        """Replace a request's hold by what it used."""
        key = principal.key
        if key is None:
            return
        if held:
            remaining = self._reserved.get(key.id, 0) - held
            if remaining > 0:
                self._reserved[key.id] = remaining
            else:
                self._reserved.pop(key.id, None)
        if used:
            self._charged[key.id] = self._charged.get(key.id, 0) + used
