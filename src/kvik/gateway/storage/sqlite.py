"""SQLite backend: one file, one connection shared by threads under a lock, WAL so the CLI can add a
key while a gateway is serving from the same file."""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvik.core.errors import ConfigError
from kvik.gateway.storage.database import Database, Row


class SqliteDatabase(Database):
    dialect = "sqlite"

    def __init__(self, path: str) -> None:
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            _create_private(path)
        try:
            # isolation_level=None: autocommit; transactions are explicit (see `transaction`).
            self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=10)
        except sqlite3.Error as exc:
            raise ConfigError(f"database_url: cannot open SQLite file {path}: {exc}") from None
        self._conn.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        if path != ":memory:":
            self._enable_wal()

    def _enable_wal(self) -> None:
        # Switching to WAL needs a moment with no other connection in the file, and SQLite reports
        # "database is locked" at once instead of waiting, e.g. when two gateways start together.
        for attempt in range(100):
            try:
                self._conn.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError:
                if attempt == 99:
                    raise
                time.sleep(0.05)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        with self._lock:
            return self._conn.execute(sql, params).rowcount

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        with self._lock:
            self._conn.executemany(sql, rows)

    def fetchall(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        with self._lock:
            return [dict(row) for row in self._conn.execute(sql, params).fetchall()]

    @contextmanager
    def transaction(self) -> Iterator[None]:
        with self._lock:
            # IMMEDIATE takes the write lock up front, so two processes migrating the same file
            # serialise instead of failing half-way.
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _create_private(path: str) -> None:
    """Create the database file readable by its owner only (0600): it holds key hashes and every
    request's metadata. SQLite gives the -wal and -shm files it adds the same mode. An existing
    file keeps the mode its operator gave it."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"database_url: cannot create SQLite file {path}: {exc}") from None
