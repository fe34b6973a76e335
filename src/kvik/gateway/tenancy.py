"""Tenants: who may share what. A key's team is its tenant, or the key itself when it has no team;
with auth off every caller is one anonymous tenant.

Two things are scoped to the tenant. The response cache (an entry, and its `x-kvik-cache: hit`
header, would tell one tenant what another asked) and the replicas' prefix caches: the gateway
sends each tenant's `cache_salt` upstream, the field vLLM introduced after CVE-2025-46570 (a
prefix-cache hit is faster, and that timing leaks another tenant's prompt). The salt is an HMAC of
the tenant id under a gateway secret, so nobody who can reach a replica directly can compute another
tenant's salt, and the replica never learns key ids.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from kvik.gateway.auth import Principal

ANONYMOUS_TENANT = "anonymous"


def tenant_of(principal: Principal | None) -> str:
    key = None if principal is None else principal.key
    if key is None:
        return ANONYMOUS_TENANT
    return f"team:{key.team}" if key.team else f"key:{key.id}"


class CacheSalter:
    """`salt(tenant)`: 64 hex characters, stable for one secret. Also `pseudonym(tenant)`, the name
    the replicas' fair-share scheduler knows the tenant by (`kvik.gateway.scheduling`)."""

    def __init__(self, secret: str | None) -> None:
        self._secret = secret.encode() if secret else secrets.token_bytes(32)
        self._salts: dict[str, str] = {}

    def salt(self, tenant: str) -> str:
        salt = self._salts.get(tenant)
        if salt is None:
            if len(self._salts) >= 100_000:
                self._salts.clear()
            salt = self._salts[tenant] = hmac.new(self._secret, tenant.encode(errors="surrogatepass"),
                                                   hashlib.sha256).hexdigest()
        return salt

    def pseudonym(self, tenant: str) -> str:
        """`t-` and 16 hex characters: an HMAC of the tenant under the same secret, domain-separated
        from the salt (knowing one tells nothing of the other)."""
        return "t-" + self.salt("fair-share\0" + tenant)[:16]
