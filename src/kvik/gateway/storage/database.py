"""A small synchronous database interface over SQLite and PostgreSQL.

The gateway touches its database rarely on the hot path (key lookups are cached, usage rows are
written in batches off the event loop with `asyncio.to_thread`), so plain blocking drivers behind
one lock are enough and keep the SQL identical on both engines. Statements use `?` placeholders;
the PostgreSQL backend rewrites them to `%s`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kvik.core.errors import ConfigError

Row = dict[str, Any]


class Database(ABC):
    dialect: str  # "sqlite" or "postgresql": migrations pick column types by it

    @abstractmethod
    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement; return the number of rows it changed."""

    @abstractmethod
    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None: ...

    @abstractmethod
    def fetchall(self, sql: str, params: Sequence[Any] = ()) -> list[Row]: ...

    @abstractmethod
    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Statements inside run atomically and exclusively (other writers wait)."""

    @abstractmethod
    def close(self) -> None: ...

    def fetchone(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        rows = self.fetchall(sql, params)
        return rows[0] if rows else None


def open_database(url: str) -> Database:
    """`sqlite:///path` (or `sqlite:///:memory:`) or `postgresql://...`; the schema is migrated."""
    from kvik.gateway.storage.migrations import migrate

    if url.startswith("sqlite:///"):
        from kvik.gateway.storage.sqlite import SqliteDatabase

        db: Database = SqliteDatabase(url[len("sqlite:///"):])
    elif url.startswith(("postgresql://", "postgres://")):
        from kvik.gateway.storage.postgres import PostgresDatabase

        db = PostgresDatabase(url)
    else:
        raise ConfigError(f"database_url: {url!r} is neither sqlite:/// nor postgresql://")
    migrate(db)
    return db
