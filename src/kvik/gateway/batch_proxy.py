"""The Batch API through the gateway: /v1/files and /v1/batches passed to the kvik server that runs
batches (`batches.upstream` in the config), per key.

The server keeps files and batches per tenant; the gateway names the tenant (`X-Kvik-Tenant`: the key
id) and its fair-share weight on every call, so each key sees only its own. Bodies are passed as
bytes (multipart uploads included) within the gateway's `limits.max_body_bytes`. Creating a file or
a batch is refused like a request when the key's budget is used up, and counts against its RPM (its
tokens are unknown until it runs, so nothing is reserved); a batch's tokens are charged to the
key's budget once, the first time the gateway sees it finished (any read of it: the SDK's polling
does), as one usage row (endpoint `batch`, model `batch`). They are not counted against the key's
TPM: a batch runs in the background tier, on capacity interactive traffic leaves idle.
`gateway_batches` remembers which batches were charged.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from kvik.core.errors import NotFoundError, QuotaExceededError, UpstreamError
from kvik.gateway.auth import Principal
from kvik.gateway.state import GatewayState
from kvik.gateway.tokens import TokenEstimate
from kvik.gateway.usage import UsageRecord

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
# Admission of a new file or batch: what it will use is not known yet.
_NOTHING_YET = TokenEstimate(prompt=0, completion=0, explicit=False)


class BatchProxy:
    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def forward(self, principal: Principal, method: str, path: str, query: str, body: bytes,
                      content_type: str | None) -> httpx.Response:
        state = self.state
        if state.config.batches is None:
            raise NotFoundError("the Batch API is not configured on this gateway (set batches.upstream)")
        upstream = state.config.batches.upstream
        if method == "POST" and path in ("/v1/batches", "/v1/files"):
            try:
                state.auth.budgets.reserve(principal, _NOTHING_YET)  # holds 0; refuses a spent budget
            except QuotaExceededError:
                state.metrics.rate_limited.labels("budget").inc()
                raise
            await state.limiter.admit(principal, _NOTHING_YET)  # holds no TPM; counts RPM
        weight = (await state.scheduling.of(principal)).weight
        headers = {"x-kvik-tenant": state.scheduling.batch_owner(principal), "x-kvik-tenant-weight": str(weight),
                   "accept-encoding": "identity"}
        if content_type:
            headers["content-type"] = content_type
        if upstream.api_key:
            headers["authorization"] = f"Bearer {upstream.api_key}"
        url = upstream.url + path + (f"?{query}" if query else "")
        try:
            response = await state.client.request(method, url, content=body or None, headers=headers)
        except httpx.TransportError as exc:
            raise UpstreamError(f"the batch server at {upstream.url} could not be reached ({type(exc).__name__})") from None
        if response.status_code == 200 and path.startswith("/v1/batches"):
            await self._track(principal, method, path, response)
        return response

    async def _track(self, principal: Principal, method: str, path: str, response: httpx.Response) -> None:
        try:
            payload = response.json()
        except ValueError:
            return
        batches = payload.get("data", []) if payload.get("object") == "list" else [payload]
        for batch in batches:
            if not isinstance(batch, dict) or not isinstance(batch.get("id"), str):
                continue
            if method == "POST" and path == "/v1/batches":
                await asyncio.to_thread(self._remember, batch["id"], principal.key_id)
            if batch.get("status") in TERMINAL:
                await self._charge(principal, batch)

    def _remember(self, batch_id: str, key_id: str | None) -> None:
        self.state.db.execute("INSERT INTO gateway_batches (batch_id, key_id, created_at) VALUES (?, ?, ?)",
                              (batch_id, key_id, time.time()))

    async def _charge(self, principal: Principal, batch: dict[str, Any]) -> None:
        usage = batch.get("usage") or {}
        claimed = await asyncio.to_thread(
            self.state.db.execute,
            "UPDATE gateway_batches SET charged_at = ? WHERE batch_id = ? AND charged_at IS NULL",
            (time.time(), batch["id"]))
        if not claimed:
            return  # charged already, or not created through this gateway
        prompt, completion = int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0)
        self.state.auth.budgets.settle(principal, 0, prompt + completion)
        self.state.usage.record(UsageRecord(
            created_at=float(batch.get("created_at") or time.time()), request_id=batch["id"],
            key_id=principal.key_id, model="batch", replica=self.state.config.batches.upstream.url,
            endpoint="batch", stream=False, cached=False, status=200, prompt_tokens=prompt,
            completion_tokens=completion, latency_ms=0.0, attempts=1))

