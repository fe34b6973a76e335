"""Usage and audit: one row per request, written in batches off the event loop, and the
aggregation behind `GET /admin/usage`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import astuple, dataclass
from typing import Any

from kvik.core.errors import InvalidRequestError
from kvik.gateway.keys import KeyStore
from kvik.gateway.storage.database import Database

logger = logging.getLogger("kvik.gateway.usage")

GROUP_COLUMNS = {"key": "key_id", "model": "model", "replica": "replica", "status": "status"}


@dataclass(slots=True)
class UsageRecord:
    created_at: float  # unix seconds when the request arrived
    request_id: str
    key_id: str | None
    model: str
    replica: str | None
    endpoint: str
    stream: bool
    cached: bool
    status: int
    prompt_tokens: int
    completion_tokens: int
    latency_ms: float
    attempts: int


class UsageRecorder:
    """Queues rows and flushes them every `flush_interval_s` (or when asked) in one transaction.

    A lost row is better than a slow request: the queue is bounded and drops (with a log line)
    when the database cannot keep up.
    """

    def __init__(self, db: Database, keys: KeyStore, *, flush_interval_s: float = 0.5,
                 max_queue: int = 100_000,
                 on_persisted: Callable[[Mapping[str, int]], None] | None = None) -> None:
        self._db = db
        self._keys = keys
        self._on_persisted = on_persisted  # told the tokens added to each key's tokens_used
        self._interval = flush_interval_s
        self._max_queue = max_queue
        self._pending: list[UsageRecord] = []
        self._task: asyncio.Task[None] | None = None
        self._flush_lock = asyncio.Lock()
        self.dropped = 0

    def record(self, row: UsageRecord) -> None:
        if len(self._pending) >= self._max_queue:
            self.dropped += 1
            return
        self._pending.append(row)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvik-gateway-usage")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.flush()

    async def flush(self) -> None:
        async with self._flush_lock:
            rows, self._pending = self._pending, []
            if rows:
                totals = await asyncio.to_thread(self._write, rows)
                if self._on_persisted is not None:
                    self._on_persisted(totals)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.flush()
            except Exception:  # keep serving; the next flush retries with new rows
                logger.exception("writing usage rows failed")

    def _write(self, rows: list[UsageRecord]) -> dict[str, int]:
        self._db.executemany(
            "INSERT INTO usage_records (created_at, request_id, key_id, model, replica, endpoint, stream, "
            "cached, status, prompt_tokens, completion_tokens, latency_ms, attempts) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [_db_tuple(row) for row in rows])
        totals: dict[str, int] = {}
        for row in rows:
            if row.key_id is not None and not row.cached:
                totals[row.key_id] = totals.get(row.key_id, 0) + row.prompt_tokens + row.completion_tokens
        self._keys.add_tokens_used(totals)
        return totals


def _db_tuple(row: UsageRecord) -> tuple[Any, ...]:
    values = list(astuple(row))
    values[6], values[7] = int(row.stream), int(row.cached)  # booleans as 0/1 on both engines
    return tuple(values)


def aggregate_usage(db: Database, *, group_by: list[str], since: float | None = None,
                    until: float | None = None, key_id: str | None = None) -> list[dict[str, Any]]:
    """Requests, errors, cache hits, tokens and latency per group (default: per key and model)."""
    unknown = [g for g in group_by if g not in GROUP_COLUMNS]
    if unknown or not group_by:
        raise InvalidRequestError(f"group_by: use a comma-separated subset of {', '.join(GROUP_COLUMNS)}",
                                  param="group_by")
    columns = [GROUP_COLUMNS[g] for g in group_by]
    conditions, params = [], []
    for clause, value in (("created_at >= ?", since), ("created_at < ?", until), ("key_id = ?", key_id)):
        if value is not None:
            conditions.append(clause)
            params.append(value)
    where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
    select = ", ".join(columns)
    rows = db.fetchall(
        f"SELECT {select}, COUNT(*) AS requests, "
        f"SUM(CASE WHEN status >= 400 THEN 1 ELSE 0 END) AS errors, SUM(cached) AS cached, "
        f"SUM(prompt_tokens) AS prompt_tokens, SUM(completion_tokens) AS completion_tokens, "
        f"AVG(latency_ms) AS avg_latency_ms, MAX(latency_ms) AS max_latency_ms "
        f"FROM usage_records{where} GROUP BY {select} ORDER BY {select}", params)
    out = []
    for row in rows:
        item = {column: row[column] for column in columns}
        item.update(requests=int(row["requests"]), errors=int(row["errors"] or 0), cached=int(row["cached"] or 0),
                    prompt_tokens=int(row["prompt_tokens"] or 0),
                    completion_tokens=int(row["completion_tokens"] or 0),
                    avg_latency_ms=round(float(row["avg_latency_ms"] or 0), 3),
                    max_latency_ms=round(float(row["max_latency_ms"] or 0), 3))
        item["total_tokens"] = item["prompt_tokens"] + item["completion_tokens"]
        out.append(item)
    return out
