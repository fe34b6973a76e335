"""Stored responses through the gateway: which replica holds each one, and whose it is.

A Responses API call with `store` (the default) leaves the response and its conversation in the
store of the replica that answered it; no other replica has them. The gateway remembers, per
response id, the tenant that made it, the model and that replica (`response_routes` in its
database, so every gateway instance on one PostgreSQL knows), and so:

- `previous_response_id` continues the conversation on that replica and no other: only it has the
  conversation (and the conversation's KV blocks in its prefix cache). When it is down for now the
  answer is 503 with Retry-After; when it has left the pool, 404 (the conversation went with it);
  when the request names a model that replica does not serve, 400.
- `GET` and `DELETE /v1/responses/{id}`, and `GET /v1/responses/{id}/input_items`, are sent to
  that replica.
- A tenant reaches only its own responses: an id another tenant made, or one not made through this
  gateway, is the same 404 as an unknown id, so one tenant cannot probe for another's. (The replicas
  check the per-tenant `cache_salt` on `previous_response_id` as well.)

A response relayed without `store` is not remembered. A route is kept for `responses.retention_days`
(30, the replicas' default `--responses-retention-days`), forgotten when the response is deleted or
its replica no longer has it, and swept with a new route at most once a minute. The gateway never
caches Responses answers: each one is new state on a replica.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
from fastapi.responses import Response

from kvik.core.errors import InvalidRequestError, NotFoundError, ServiceUnavailableError, UpstreamError
from kvik.gateway.auth import Principal
from kvik.gateway.replica import Replica
from kvik.gateway.router import ModelPool
from kvik.gateway.state import GatewayState
from kvik.gateway.tenancy import tenant_of

# What a replica's response ids look like (kvik serve: `resp_` and 32 hex digits; OpenAI's are
# similar). Anything else a replica returns is not remembered, so no stored id ever needs escaping.
_RESPONSE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
SWEEP_INTERVAL_S = 60.0


@dataclass(slots=True, frozen=True)
class ResponseRoute:
    response_id: str
    tenant: str
    model: str  # the pool's name when it was made
    replica: str  # the replica's URL
    context_tokens: int  # the conversation's tokens up to and including this response


@dataclass(slots=True, frozen=True)
class Continuation:
    """Where a request with `previous_response_id` must go, and the tokens of the conversation it
    continues: its prompt beyond its own input, reserved at admission like the input itself."""
    replica: Replica
    context_tokens: int


def not_found(response_id: str, param: str | None = None) -> NotFoundError:
    # The same words whether the id is unknown or another tenant's.
    return NotFoundError(f"No response found with id {response_id[:128]!r}.", param=param)


class StoredResponses:
    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self._swept = 0.0  # time.monotonic() of the last sweep

    def _cutoff(self) -> float:
        """Routes made before this have expired; -1 when none expire (`retention_days: 0`)."""
        days = self.state.config.responses.retention_days
        return time.time() - days * 86400 if days > 0 else -1.0

    async def remember(self, response_id: Any, principal: Principal | None, model: str, replica: str,
                       context_tokens: int) -> None:
        """`context_tokens`: the response's input plus output tokens, as its replica counted them."""
        if not isinstance(response_id, str) or not _RESPONSE_ID.fullmatch(response_id):
            return
        await asyncio.to_thread(
            self.state.db.execute,
            "INSERT INTO response_routes (response_id, tenant, model, replica, created_at, context_tokens) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (response_id, tenant_of(principal), model, replica, time.time(), max(0, context_tokens)))
        if time.monotonic() - self._swept >= SWEEP_INTERVAL_S:
            self._swept = time.monotonic()
            await self.sweep()

    async def sweep(self) -> int:
        """Forget the expired routes; how many there were."""
        return await asyncio.to_thread(self.state.db.execute, "DELETE FROM response_routes WHERE created_at < ?",
                                       (self._cutoff(),))

    async def forget(self, response_id: str) -> None:
        await asyncio.to_thread(self.state.db.execute, "DELETE FROM response_routes WHERE response_id = ?",
                                (response_id,))

    async def lookup(self, response_id: str, principal: Principal | None) -> ResponseRoute | None:
        """The route of one of the caller's tenant's responses; None for any other id."""
        if not _RESPONSE_ID.fullmatch(response_id):
            return None
        row = await asyncio.to_thread(
            self.state.db.fetchone,
            "SELECT response_id, tenant, model, replica, context_tokens FROM response_routes "
            "WHERE response_id = ? AND tenant = ? AND created_at >= ?",
            (response_id, tenant_of(principal), self._cutoff()))
        return None if row is None else ResponseRoute(**row)

    async def pin(self, body: dict[str, Any], principal: Principal | None, pool: ModelPool) -> Continuation | None:
        """Where a request with `previous_response_id` must go (None without one), or the 4xx/503
        that says why it cannot go anywhere."""
        previous = body.get("previous_response_id")
        if previous is None:
            return None
        route = await self.lookup(previous, principal)
        if route is None:
            raise not_found(previous, "previous_response_id")
        replica = next((r for r in pool.replicas if r.url == route.replica), None)
        if replica is None:
            if route.model != pool.name:
                raise InvalidRequestError(
                    f"previous_response_id: {previous!r} was made by the model {route.model!r}, whose replica "
                    f"stores the conversation and does not serve {pool.name!r}; continue it with the model "
                    f"{route.model!r}.", param="model")
            raise NotFoundError(
                f"previous_response_id: {previous!r} was stored by a replica of {pool.name!r} that is no longer "
                f"in this gateway's pool, and its conversation went with it. Start a new conversation (send the "
                f"earlier turns as input items instead).", param="previous_response_id")
        if not replica.is_available():
            raise ServiceUnavailableError(
                f"The replica that stores the conversation of {previous!r} is unavailable right now "
                f"({replica.phase}); only it can continue the conversation. Retry later.",
                retry_after=replica.breaker.retry_after() or 5.0)
        return Continuation(replica, route.context_tokens)

    async def forward(self, principal: Principal, method: str, response_id: str, *, suffix: str = "",
                      query: str = "") -> Response:
        """`GET` or `DELETE /v1/responses/{id}` (or `GET .../input_items`: `suffix`, with the
        client's `query`) on the replica that stores it."""
        route = await self.lookup(response_id, principal)
        if route is None:
            raise not_found(response_id, "response_id")
        self.state.auth.authorize_model(principal, route.model)
        replica = next((r for r in self.state.router.all_replicas() if r.url == route.replica), None)
        if replica is None:
            raise NotFoundError(f"Response {response_id!r} was stored by a replica that is no longer in this "
                                f"gateway's pool, and went with it.", param="response_id")
        headers = {"accept-encoding": "identity"}
        if replica.api_key:
            headers["authorization"] = f"Bearer {replica.api_key}"
        try:
            answer = await self.state.client.request(
                method, f"{replica.url}/v1/responses/{quote(response_id)}{suffix}" + (f"?{query}" if query else ""),
                headers=headers)
        except httpx.TransportError as exc:
            raise UpstreamError(f"The replica that stores response {response_id!r} could not be reached "
                                f"({type(exc).__name__}).") from None
        # Deleted now, or the replica no longer has it (a 404 for the response itself: a replica
        # without the input_items route answers 404 for that path too).
        if (method == "DELETE" and answer.status_code == 200) or (answer.status_code == 404 and not suffix):
            await self.forget(response_id)
        return Response(answer.content, status_code=answer.status_code,
                        media_type=answer.headers.get("content-type", "application/json"))
