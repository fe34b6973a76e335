"""Stored responses of the Responses API, in SQLite (a file, or `:memory:` for the process's life).

Each row holds the response object as returned (for `GET /v1/responses/{id}`) and the conversation
state a later turn continues from (`previous_response_id`): the chat messages so far, and the exact
prompt and output token ids of this turn, so the next turn's prompt can start with those very tokens
and reuse their KV blocks through the prefix cache.

sqlite3 blocks, so every call runs in a worker thread; one connection, serialised by a lock. The
database is opened on first use, so a server that never stores a response never creates the file.

Responses are kept for `retention_s` (`--responses-retention-days`, 30 by default, as OpenAI keeps
them; 0 keeps them for good). Each turn stores its whole conversation, so without a limit a client
that keeps storing fills the disk that every tenant's requests share. An expired response is gone
for GET and `previous_response_id` at once; its row is deleted by a sweep that runs with a save at
most once a minute.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvik.core.errors import ServiceUnavailableError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    response TEXT NOT NULL,      -- the response object, JSON
    conversation TEXT NOT NULL   -- StoredConversation, JSON
);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created_at)
"""
SWEEP_INTERVAL_S = 60.0


@dataclass(slots=True)
class StoredConversation:
    messages: list[dict[str, Any]]  # chat messages up to and including this turn's answer (no instructions)
    prompt_text: str  # this turn's rendered prompt
    prompt_token_ids: list[int]
    output_text: str  # the answer as the engine decoded it (before any tool-call parsing)
    output_token_ids: list[int]
    cache_salt: str | None = None  # the tenant's salt: a later turn must carry the same one
    instructions: str | None = None


@dataclass(slots=True)
class StoredResponse:
    id: str
    response: dict[str, Any]
    conversation: StoredConversation
    created_at: float = field(default_factory=time.time)


class ResponseStore:
    def __init__(self, path: str, retention_s: float = 0.0) -> None:
        self.path = path
        self.retention_s = retention_s  # 0: kept until deleted
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self._swept = 0.0  # time.monotonic() of the last sweep of expired rows

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            target = self.path
            try:
                if target != ":memory:":
                    target = str(Path(target).expanduser())
                    Path(target).parent.mkdir(parents=True, exist_ok=True)
                db = sqlite3.connect(target, check_same_thread=False, isolation_level=None)
                db.execute("PRAGMA journal_mode=WAL")
                db.executescript(_SCHEMA)
            except (OSError, sqlite3.Error) as exc:
                raise ServiceUnavailableError(f"the response store {self.path} cannot be opened ({exc})",
                                              retry_after=30, code="store_unavailable") from exc
            self._db = db
        return self._db

    def _execute(self, sql: str, args: tuple, fetch: bool) -> tuple | int | None:
        """One statement under the lock: the first row when `fetch`, else the rows it changed."""
        with self._lock:
            try:
                cursor = self._connection().execute(sql, args)
                return cursor.fetchone() if fetch else cursor.rowcount
            except sqlite3.Error as exc:
                raise ServiceUnavailableError(f"the response store failed ({exc})", retry_after=5,
                                              code="store_unavailable") from exc

    def _cutoff(self) -> float:
        """Rows created before this are expired (-inf when nothing expires)."""
        return time.time() - self.retention_s if self.retention_s > 0 else float("-inf")

    async def save(self, record: StoredResponse) -> None:
        await asyncio.to_thread(
            self._execute, "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)",
            (record.id, record.created_at, json.dumps(record.response, ensure_ascii=False),
             json.dumps(asdict(record.conversation), ensure_ascii=False)), False)
        if self.retention_s > 0 and time.monotonic() - self._swept >= SWEEP_INTERVAL_S:
            self._swept = time.monotonic()
            await self.sweep()

    async def sweep(self) -> int:
        """Delete the expired rows; how many there were."""
        return await asyncio.to_thread(self._execute, "DELETE FROM responses WHERE created_at < ?",
                                       (self._cutoff(),), False)

    async def load(self, response_id: str) -> StoredResponse | None:
        row = await asyncio.to_thread(
            self._execute, "SELECT id, created_at, response, conversation FROM responses WHERE id = ? "
            "AND created_at >= ?", (response_id, self._cutoff()), True)
        if row is None:
            return None
        row_id, created_at, response, conversation = row
        return StoredResponse(row_id, json.loads(response), StoredConversation(**json.loads(conversation)),
                              created_at)

    async def delete(self, response_id: str) -> bool:
        changed = await asyncio.to_thread(self._execute, "DELETE FROM responses WHERE id = ? AND created_at >= ?",
                                          (response_id, self._cutoff()), False)
        return changed > 0

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
