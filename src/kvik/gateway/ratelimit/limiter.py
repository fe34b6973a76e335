"""Per-key limits: requests per minute and tokens per minute (prompt + completion).

RPM is counted when a request is admitted. TPM is reserved at admission (the request's estimated
prompt plus its max_tokens, see `kvik.gateway.tokens`) and settled when the request ends: the
difference between what it used and what it reserved is added (or given back). Concurrent requests
therefore see each other's reservations and cannot all slip under the limit, and a request that
never reports usage is still charged its reservation or what was relayed.
"""

from __future__ import annotations

from kvik.core.errors import RateLimitError
from kvik.gateway.auth import Principal
from kvik.gateway.config import LimitsConfig
from kvik.gateway.metrics import GatewayMetrics
from kvik.gateway.ratelimit.backend import CounterBackend
from kvik.gateway.tokens import TokenEstimate

WINDOW_S = 60.0


class RateLimiter:
    def __init__(self, backend: CounterBackend, defaults: LimitsConfig, metrics: GatewayMetrics) -> None:
        self.backend = backend
        self._defaults = defaults
        self._metrics = metrics

    def reconfigure(self, defaults: LimitsConfig) -> None:
        """Reloaded default limits; counts so far are kept."""
        self._defaults = defaults

    def tpm_of(self, principal: Principal) -> int | None:
        key = principal.key
        return None if key is None else key.tpm or self._defaults.default_tpm

    async def admit(self, principal: Principal, estimate: TokenEstimate) -> int:
        """Admit the request or raise `RateLimitError` (429 with Retry-After); return the TPM tokens
        reserved for it, to be passed to `settle` when it ends."""
        key = principal.key
        if key is None:
            return 0
        tpm = self.tpm_of(principal)
        rpm = key.rpm or self._defaults.default_rpm
        reserved = 0
        # TPM first: a request refused for tokens must not use up an RPM slot.
        if tpm is not None:
            if estimate.explicit and estimate.completion > tpm:
                self._metrics.rate_limited.labels("tpm").inc()
                raise RateLimitError(
                    f"Request too large: it may generate {estimate.completion} tokens (max_tokens x choices) "
                    f"and this key may use {tpm} tokens per minute; lower max_tokens.",
                    retry_after=WINDOW_S, param="max_tokens")
            # Clamped: a generous prompt estimate must not make a request that fits impossible.
            cost = min(estimate.total, tpm)
            decision = await self.backend.hit(f"{key.id}:tpm", tpm, cost, WINDOW_S)
            if not decision.allowed:
                self._metrics.rate_limited.labels("tpm").inc()
                raise RateLimitError(f"Rate limit reached: this key may use {tpm} tokens per minute.",
                                     retry_after=decision.retry_after_s)
            reserved = cost
        if rpm is not None:
            decision = await self.backend.hit(f"{key.id}:rpm", rpm, 1, WINDOW_S)
            if not decision.allowed:
                if reserved:
                    await self.backend.add(f"{key.id}:tpm", -reserved, WINDOW_S)
                self._metrics.rate_limited.labels("rpm").inc()
                raise RateLimitError(f"Rate limit reached: this key may send {rpm} requests per minute.",
                                     retry_after=decision.retry_after_s)
        return reserved

    async def settle(self, principal: Principal, reserved: int, used: int) -> None:
        """Replace the request's TPM reservation by what it used."""
        key = principal.key
        if key is None or self.tpm_of(principal) is None or used == reserved:
            return
        await self.backend.add(f"{key.id}:tpm", used - reserved, WINDOW_S)
