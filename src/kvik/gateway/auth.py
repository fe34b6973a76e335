"""Who is calling: bearer keys to `Principal`s, with a short per-process cache in front of the
database so the hot path does not query it on every request."""

from __future__ import annotations

import asyncio
import hmac
import time
from dataclasses import dataclass

from kvik.core.errors import AuthenticationError, PermissionDeniedError, QuotaExceededError
from kvik.gateway.config import AuthConfig
from kvik.gateway.keys import ApiKey, KeyStore, hash_secret

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
        self._config = config
        self._keys = keys
        self._cache: dict[str, tuple[float, ApiKey]] = {}  # sha256 -> (expiry, key)
        self._bootstrap = None if config.admin_key is None else ApiKey(
            id=BOOTSTRAP_ADMIN_ID, name="auth.admin_key", key_prefix=config.admin_key[:12], role="admin",
            models=None, rpm=None, tpm=None, token_budget=None, tokens_used=0, created_at=0.0)

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

    @staticmethod
    def check_budget(principal: Principal) -> None:
        key = principal.key
        if key is not None and key.token_budget is not None and key.tokens_used >= key.token_budget:
            raise QuotaExceededError(f"This API key has used its budget of {key.token_budget} tokens.")

    def note_tokens(self, principal: Principal, tokens: int) -> None:
        """Count tokens against the cached copy of the key at once; the database catches up with the
        next usage flush, and the next cache refresh reads it back."""
        if principal.key is not None:
            principal.key.tokens_used += tokens

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
        key = await asyncio.to_thread(self._keys.lookup, secret)
        if key is None:
            self._cache.pop(digest, None)
            raise AuthenticationError("Incorrect API key provided. Create one with `kvik gateway keys create`.")
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
