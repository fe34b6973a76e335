"""PostgreSQL backend (psycopg 3): the same schema and SQL as SQLite, `?` rewritten to `%s`."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kvik.core.errors import ConfigError
from kvik.gateway.storage.database import Database, Row

# Taken for the duration of a migration so that gateways starting together migrate one at a time.
MIGRATION_LOCK_ID = 0x6B76696B  # "kvik"


class PostgresDatabase(Database):
    dialect = "postgresql"

    def __init__(self, url: str) -> None:
        try:
            import psycopg
            from psycopg.rows import dict_row
        except ImportError:
            raise ConfigError("database_url: PostgreSQL needs psycopg; pip install 'kvik[gateway]'") from None
        self._psycopg = psycopg
        self._url = url
        self._row_factory = dict_row
        self._lock = threading.RLock()
        self._conn = self._connect()

    def _connect(self) -> Any:
        try:
            return self._psycopg.connect(self._url, autocommit=True, row_factory=self._row_factory,
                                         connect_timeout=10)
        except self._psycopg.OperationalError as exc:
            raise ConfigError(f"database_url: cannot connect to PostgreSQL: {exc}") from None

    def _run(self, fn: Any) -> Any:
        with self._lock:
            if self._conn.closed:
                # The server restarted or dropped us; one reconnect, then let errors surface.
                self._conn = self._connect()
            with self._conn.cursor() as cursor:
                return fn(cursor)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        def run(cursor: Any) -> int:
            cursor.execute(_placeholders(sql), params)
            return cursor.rowcount

        return self._run(run)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self._run(lambda cursor: cursor.executemany(_placeholders(sql), rows))

    def fetchall(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        def run(cursor: Any) -> list[Row]:
            cursor.execute(_placeholders(sql), params)
            return list(cursor.fetchall())

        return self._run(run)

    @contextmanager
    def transaction(self) -> Iterator[None]:
        with self._lock, self._conn.transaction():
            self.execute("SELECT pg_advisory_xact_lock(?)", (MIGRATION_LOCK_ID,))
            yield

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _placeholders(sql: str) -> str:
    # Our statements never contain a literal "?" or "%", so a plain replace is safe.
    return sql.replace("?", "%s")
