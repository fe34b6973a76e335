"""Per-key limits: requests per minute and tokens per minute (prompt + completion, as the upstream
reported them). RPM is counted when a request is admitted; TPM is charged after the answer, so a
request is admitted while the key is under its TPM and the next one pays for any overshoot."""

from __future__ import annotations

from kvik.core.errors import RateLimitError
from kvik.gateway.auth import Principal
from kvik.gateway.config import LimitsConfig
from kvik.gateway.metrics import GatewayMetrics
from kvik.gateway.ratelimit.backend import CounterBackend

WINDOW_S = 60.0


class RateLimiter:
    def __init__(self, backend: CounterBackend, defaults: LimitsConfig, metrics: GatewayMetrics) -> None:
        self.backend = backend
        self._defaults = defaults
        self._metrics = metrics

    async def admit(self, principal: Principal) -> None:
        """Raise `RateLimitError` (429 with Retry-After) when the key is over a limit."""
        key = principal.key
        if key is None:
            return
        tpm = key.tpm or self._defaults.default_tpm
        rpm = key.rpm or self._defaults.default_rpm
        # TPM first and without counting: a request refused for tokens must not use up an RPM slot.
        if tpm is not None:
            decision = await self.backend.hit(f"{key.id}:tpm", tpm, 1, WINDOW_S, count=False)
            if not decision.allowed:
                self._metrics.rate_limited.labels("tpm").inc()
                raise RateLimitError(f"Rate limit reached: this key may use {tpm} tokens per minute.",
                                     retry_after=decision.retry_after_s)
        if rpm is not None:
            decision = await self.backend.hit(f"{key.id}:rpm", rpm, 1, WINDOW_S)
            if not decision.allowed:
                self._metrics.rate_limited.labels("rpm").inc()
                raise RateLimitError(f"Rate limit reached: this key may send {rpm} requests per minute.",
                                     retry_after=decision.retry_after_s)

    async def charge_tokens(self, principal: Principal, tokens: int) -> None:
        key = principal.key
        if key is None or tokens <= 0 or (key.tpm or self._defaults.default_tpm) is None:
            return
        await self.backend.add(f"{key.id}:tpm", tokens, WINDOW_S)
