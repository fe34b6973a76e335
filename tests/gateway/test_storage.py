"""Keys and usage storage on SQLite and on a real PostgreSQL: same schema, same behaviour."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvik.core.errors import InvalidRequestError, NotFoundError
from kvik.gateway.keys import KeyStore, hash_secret
from kvik.gateway.storage import Database, open_database
from kvik.gateway.storage.migrations import MIGRATIONS, migrate, schema_version
from kvik.gateway.usage import UsageRecord, aggregate_usage


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'gateway.db'}"
    cluster = request.getfixturevalue("postgres_server")
    return cluster.create_database(f"kvik_storage_{secrets.token_hex(4)}")


@pytest.fixture
def db(database_url: str) -> Iterator[Database]:
    database = open_database(database_url)
    yield database
    database.close()


def test_migrations_apply_once(db: Database, database_url: str) -> None:
    assert schema_version(db) == MIGRATIONS[-1][0]
    assert migrate(db) == []  # nothing left to apply
    again = open_database(database_url)
    assert schema_version(again) == MIGRATIONS[-1][0]
    again.close()


def test_concurrent_first_start_migrates_once(database_url: str) -> None:
    # Two gateways starting on an empty database at the same moment.
    errors: list[BaseException] = []

    def start() -> None:
        try:
            open_database(database_url).close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


def test_keys_are_stored_hashed_and_revocable(db: Database) -> None:
    store = KeyStore(db)
    new = store.create("alice", role="user", models=["tiny"], rpm=10, tpm=1000, token_budget=5000)
    assert new.secret.startswith("kvik-") and len(new.secret) > 40
    rows = db.fetchall("SELECT * FROM api_keys")
    assert new.secret not in repr(rows) and rows[0]["key_hash"] == hash_secret(new.secret)
    found = store.lookup(new.secret)
    assert found is not None and found.models == ["tiny"] and found.allows_model("tiny")
    assert not found.allows_model("other")
    assert store.lookup(new.secret + "x") is None
    store.revoke(new.key.id)
    assert store.lookup(new.secret) is None
    assert store.list() == [] and len(store.list(include_revoked=True)) == 1
    with pytest.raises(NotFoundError):
        store.revoke("key_missing")
    with pytest.raises(InvalidRequestError, match="role"):
        store.create("bob", role="root")


def test_usage_aggregates_per_key_and_model(db: Database) -> None:
    store = KeyStore(db)
    key = store.create("alice").key
    now = time.time()
    rows = [
        UsageRecord(now, "r1", key.id, "tiny", "http://a", "chat.completions", False, False, 200, 10, 5, 12.0, 1),
        UsageRecord(now, "r2", key.id, "tiny", "http://b", "chat.completions", True, False, 200, 20, 5, 30.0, 2),
        UsageRecord(now, "r3", key.id, "tiny", None, "chat.completions", False, False, 429, 0, 0, 1.0, 0),
        UsageRecord(now, "r4", key.id, "other", "http://a", "completions", False, True, 200, 0, 0, 2.0, 0),
    ]
    db.executemany(
        "INSERT INTO usage_records (created_at, request_id, key_id, model, replica, endpoint, stream, cached, "
        "status, prompt_tokens, completion_tokens, latency_ms, attempts) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
        [(r.created_at, r.request_id, r.key_id, r.model, r.replica, r.endpoint, int(r.stream), int(r.cached),
          r.status, r.prompt_tokens, r.completion_tokens, r.latency_ms, r.attempts) for r in rows])
    by_model = {row["model"]: row for row in aggregate_usage(db, group_by=["key", "model"])}
    tiny = by_model["tiny"]
    assert (tiny["key_id"], tiny["requests"], tiny["errors"], tiny["total_tokens"]) == (key.id, 3, 1, 40)
    assert by_model["other"]["cached"] == 1
    assert aggregate_usage(db, group_by=["model"], since=now + 1) == []
    with pytest.raises(InvalidRequestError):
        aggregate_usage(db, group_by=["password"])


def test_a_new_sqlite_database_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    """Issue 10, finding 12: the file holds key hashes and every request's metadata."""
    import os
    import stat

    path = tmp_path / "private" / "gateway.db"
    database = open_database(f"sqlite:///{path}")
    store = KeyStore(database)
    store.create("owner-only", team="ops")  # a write, so the WAL and shared-memory files exist
    try:
        for file in (path, path.with_name("gateway.db-wal"), path.with_name("gateway.db-shm")):
            assert file.exists() and stat.S_IMODE(os.stat(file).st_mode) == 0o600, file
    finally:
        database.close()
