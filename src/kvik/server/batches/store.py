"""Files and batches in SQLite: what the Batch API needs to survive a restart.

Three tables: `files` (uploaded inputs and the output/error files a batch produces, content
included), `batches` (state, timestamps, token usage) and `batch_results` (one row per finished line,
keyed by (batch, line) and carrying the line's custom_id). A line's result and the batch's usage
counters change in one transaction, and the key makes a second write of the same line a no-op, so
after a crash (kill -9) the batch resumes from what was committed: no line is lost (unrecorded
lines run again) and none is recorded twice.

The database runs in WAL mode with synchronous=NORMAL: a committed transaction survives the
process dying. An exclusive lock on `<db>.lock` keeps two servers from running the same batches.
All calls are synchronous; the API runs them on one worker thread (`BatchStore.run`).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from kvik.core.errors import ConfigError

T = TypeVar("T")

ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL_STATUSES = ("completed", "failed", "expired", "cancelled")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,                 -- the tenant that uploaded it ('' without a gateway)
    purpose TEXT NOT NULL,               -- 'batch' (inputs) or 'batch_output' (results, errors)
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    num_lines INTEGER NOT NULL,          -- requests in a batch input file
    created_at INTEGER NOT NULL,         -- unix seconds
    content BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS files_owner ON files (owner, created_at);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    tenant_weight REAL NOT NULL,         -- fair-share weight the owner's lines run with
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    total INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    output_file_id TEXT, error_file_id TEXT,
    errors TEXT,                         -- JSON list of {code, message, line, param}
    metadata TEXT,                       -- JSON object of the client's strings
    input_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS batches_owner ON batches (owner, created_at);
CREATE TABLE IF NOT EXISTS batch_results (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,               -- 0-based index of the request in the input file
    custom_id TEXT NOT NULL,
    ok INTEGER NOT NULL,                 -- 1: goes to the output file, 0: to the error file
    record TEXT NOT NULL,                -- the JSON line written to that file
    PRIMARY KEY (batch_id, line)
);
"""


@dataclass(slots=True)
class LineResult:
    line: int
    custom_id: str
    ok: bool
    record: dict[str, Any]
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


class BatchStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(f"{path}.lock", "a+")  # noqa: SIM115 - held for the store's life
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise ConfigError(f"batch database {path}: another server is using it; give each server its "
                              "own --batch-db") from None
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        os.chmod(path, 0o600)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvik-batch-db")

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        """Run a store method on the store's own thread (calls are serialised there)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._db.close()
        self._lock_file.close()

    # -- files --

    def add_file(self, row: dict[str, Any]) -> None:
        self._db.execute("INSERT INTO files (id, owner, purpose, filename, bytes, num_lines, created_at, content) "
                         "VALUES (:id, :owner, :purpose, :filename, :bytes, :num_lines, :created_at, :content)", row)

    def get_file(self, owner: str, file_id: str, *, content: bool = False) -> dict[str, Any] | None:
        columns = "*" if content else "id, owner, purpose, filename, bytes, num_lines, created_at"
        row = self._db.execute(f"SELECT {columns} FROM files WHERE id = ? AND owner = ?", (file_id, owner)).fetchone()
        return None if row is None else dict(row)

    def list_files(self, owner: str, purpose: str | None, after: str | None, limit: int,
                   newest_first: bool) -> list[dict[str, Any]]:
        return self._page("files", "id, owner, purpose, filename, bytes, num_lines, created_at", owner, after,
                          limit, newest_first, ("purpose", purpose) if purpose else None)

    def delete_file(self, owner: str, file_id: str) -> bool:
        return self._db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)).rowcount > 0

    def file_in_use(self, file_id: str) -> str | None:
        placeholders = ",".join("?" * len(ACTIVE_STATUSES))
        row = self._db.execute(f"SELECT id FROM batches WHERE input_file_id = ? AND status IN ({placeholders})",
                               (file_id, *ACTIVE_STATUSES)).fetchone()
        return None if row is None else row["id"]

    # -- batches --

    def add_batch(self, row: dict[str, Any]) -> None:
        self._db.execute(
            "INSERT INTO batches (id, owner, tenant_weight, endpoint, input_file_id, completion_window, status, "
            "total, created_at, expires_at, metadata) VALUES (:id, :owner, :tenant_weight, :endpoint, "
            ":input_file_id, :completion_window, :status, :total, :created_at, :expires_at, :metadata)", row)

    def get_batch(self, batch_id: str, owner: str | None = None) -> dict[str, Any] | None:
        if owner is None:
            row = self._db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        else:
            row = self._db.execute("SELECT * FROM batches WHERE id = ? AND owner = ?", (batch_id, owner)).fetchone()
        return None if row is None else self._with_counts(dict(row))

    def list_batches(self, owner: str, after: str | None, limit: int) -> list[dict[str, Any]]:
        return [self._with_counts(row) for row in self._page("batches", "*", owner, after, limit, True, None)]

    def active_batch_ids(self) -> list[str]:
        placeholders = ",".join("?" * len(ACTIVE_STATUSES))
        rows = self._db.execute(f"SELECT id FROM batches WHERE status IN ({placeholders}) ORDER BY created_at, id",
                                ACTIVE_STATUSES).fetchall()
        return [row["id"] for row in rows]

    def set_status(self, batch_id: str, status: str, *, only_from: tuple[str, ...] = (),
                   **fields: Any) -> bool:
        """Move a batch to `status`, stamping `<status>_at`; with `only_from`, only from those states."""
        stamp = f"{status}_at"
        values = {**fields, "status": status, stamp: int(time.time())}
        assignments = ", ".join(f"{name} = :{name}" for name in values)
        where = "id = :batch_id"
        if only_from:
            where += " AND status IN (" + ",".join(f"'{s}'" for s in only_from) + ")"
        cursor = self._db.execute(f"UPDATE batches SET {assignments} WHERE {where}", {**values, "batch_id": batch_id})
        return cursor.rowcount > 0

    def done_lines(self, batch_id: str) -> set[int]:
        rows = self._db.execute("SELECT line FROM batch_results WHERE batch_id = ?", (batch_id,)).fetchall()
        return {row["line"] for row in rows}

    def record_result(self, batch_id: str, result: LineResult) -> bool:
        """Write one line's result and add its tokens to the batch, atomically; False (and no change)
        if that line already has a result."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            cursor = self._db.execute(
                "INSERT OR IGNORE INTO batch_results (batch_id, line, custom_id, ok, record) VALUES (?, ?, ?, ?, ?)",
                (batch_id, result.line, result.custom_id, int(result.ok), json.dumps(result.record)))
            if cursor.rowcount == 0:
                return False
            self._db.execute("UPDATE batches SET input_tokens = input_tokens + ?, cached_tokens = cached_tokens + ?, "
                             "output_tokens = output_tokens + ? WHERE id = ?",
                             (result.input_tokens, result.cached_tokens, result.output_tokens, batch_id))
            return True

    def result_records(self, batch_id: str, ok: bool) -> list[str]:
        rows = self._db.execute("SELECT record FROM batch_results WHERE batch_id = ? AND ok = ? ORDER BY line",
                                (batch_id, int(ok))).fetchall()
        return [row["record"] for row in rows]

    # -- helpers --

    def _with_counts(self, row: dict[str, Any]) -> dict[str, Any]:
        counts = self._db.execute("SELECT COALESCE(SUM(ok), 0) AS completed, COUNT(*) - COALESCE(SUM(ok), 0) "
                                  "AS failed FROM batch_results WHERE batch_id = ?", (row["id"],)).fetchone()
        row["completed"], row["failed"] = counts["completed"], counts["failed"]
        return row

    def _page(self, table: str, columns: str, owner: str, after: str | None, limit: int, newest_first: bool,
              match: tuple[str, str] | None) -> list[dict[str, Any]]:
        """One page in (created_at, id) order, after the row with id `after` (a cursor)."""
        where, params = ["owner = ?"], [owner]
        if match is not None:
            where.append(f"{match[0]} = ?")
            params.append(match[1])
        if after is not None:
            cursor = self._db.execute(f"SELECT created_at FROM {table} WHERE id = ? AND owner = ?",
                                      (after, owner)).fetchone()
            if cursor is None:
                return []
            comparison = "<" if newest_first else ">"
            where.append(f"(created_at, id) {comparison} (?, ?)")
            params += [cursor["created_at"], after]
        direction = "DESC" if newest_first else "ASC"
        rows = self._db.execute(f"SELECT {columns} FROM {table} WHERE {' AND '.join(where)} "
                                f"ORDER BY created_at {direction}, id {direction} LIMIT ?", (*params, limit)).fetchall()
        return [dict(row) for row in rows]
