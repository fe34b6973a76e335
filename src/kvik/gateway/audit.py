"""The audit trail the admin console shows: admin actions (`admin_audit`) and the per-request rows
the gateway already writes (`usage_records`), each queried with filters, newest first."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import Request

from kvik.core.errors import InvalidRequestError
from kvik.gateway.storage.database import Database

MAX_ROWS = 500
ACTIONS = ("key.create", "key.update", "key.revoke", "key.scheduling", "config.reload")
STATUS_CLASSES = {"2xx": (200, 300), "4xx": (400, 500), "429": (429, 430), "5xx": (500, 600), "499": (499, 500)}


def record_action(db: Database, *, actor_key_id: str, action: str, target: str, detail: dict[str, Any]) -> None:
    db.execute("INSERT INTO admin_audit (created_at, actor_key_id, action, target, detail) VALUES (?, ?, ?, ?, ?)",
               (time.time(), actor_key_id, action, target, json.dumps(detail, sort_keys=True)))


async def record_admin_action(request: Request, action: str, target: str, detail: dict[str, Any]) -> None:
    """Audit an admin route's change; the actor is the (already checked, cached) admin key."""
    state = request.app.state.gateway
    principal = await state.auth.authenticate_admin(request.headers.get("authorization"))
    await asyncio.to_thread(record_action, state.db, actor_key_id=principal.key_id or "", action=action,
                            target=target, detail=detail)


def query_actions(db: Database, *, action: str | None = None, actor: str | None = None, target: str | None = None,
                  since: float | None = None, until: float | None = None, limit: int = 100) -> list[dict[str, Any]]:
    if action is not None and action not in ACTIONS:
        raise InvalidRequestError(f"action: use one of {', '.join(ACTIONS)}", param="action")
    where, params = _where([("action = ?", action), ("actor_key_id = ?", actor), ("target = ?", target),
                            ("created_at >= ?", since), ("created_at < ?", until)])
    rows = db.fetchall(f"SELECT * FROM admin_audit{where} ORDER BY created_at DESC, id DESC LIMIT ?",
                       [*params, _limit(limit)])
    return [{"id": int(r["id"]), "created_at": float(r["created_at"]), "actor_key_id": r["actor_key_id"],
             "action": r["action"], "target": r["target"], "detail": json.loads(r["detail"])} for r in rows]


def query_requests(db: Database, *, key_id: str | None = None, model: str | None = None,
                   status: str | None = None, since: float | None = None, until: float | None = None,
                   limit: int = 100) -> list[dict[str, Any]]:
    """Request rows; `status` is an exact code (`429`) or a class (`2xx`, `4xx`, `5xx`)."""
    low_high: tuple[int, int] | None = None
    if status is not None:
        if status in STATUS_CLASSES:
            low_high = STATUS_CLASSES[status]
        elif status.isdigit() and 100 <= int(status) <= 599:
            low_high = (int(status), int(status) + 1)
        else:
            raise InvalidRequestError("status: give a code such as 429 or a class such as 4xx", param="status")
    where, params = _where([("key_id = ?", key_id), ("model = ?", model), ("created_at >= ?", since),
                            ("created_at < ?", until),
                            ("status >= ?", low_high[0] if low_high else None),
                            ("status < ?", low_high[1] if low_high else None)])
    rows = db.fetchall(f"SELECT * FROM usage_records{where} ORDER BY created_at DESC, id DESC LIMIT ?",
                       [*params, _limit(limit)])
    return [{"id": int(r["id"]), "created_at": float(r["created_at"]), "request_id": r["request_id"],
             "key_id": r["key_id"], "model": r["model"], "replica": r["replica"], "endpoint": r["endpoint"],
             "stream": bool(r["stream"]), "cached": bool(r["cached"]), "status": int(r["status"]),
             "prompt_tokens": int(r["prompt_tokens"]), "completion_tokens": int(r["completion_tokens"]),
             "latency_ms": round(float(r["latency_ms"]), 3), "attempts": int(r["attempts"])} for r in rows]


def _where(conditions: list[tuple[str, Any]]) -> tuple[str, list[Any]]:
    clauses = [clause for clause, value in conditions if value is not None]
    params = [value for _, value in conditions if value is not None]
    return (f" WHERE {' AND '.join(clauses)}" if clauses else ""), params


def _limit(limit: int) -> int:
    return max(1, min(int(limit), MAX_ROWS))

