"""Versioned schema migrations, applied in order at start-up, each at most once per database.

Append new migrations at the end with the next version number; never edit an applied one. Column
types differ between SQLite and PostgreSQL only where the engines disagree (`{pk}`, `{real}`).
"""

from __future__ import annotations

import time

from kvik.gateway.storage.database import Database

TYPES = {
    "sqlite": {"pk": "INTEGER PRIMARY KEY AUTOINCREMENT", "real": "REAL", "bigint": "INTEGER"},
    "postgresql": {"pk": "BIGSERIAL PRIMARY KEY", "real": "DOUBLE PRECISION", "bigint": "BIGINT"},
}

# (version, description, statements)
MIGRATIONS: list[tuple[int, str, list[str]]] = [
    (1, "api keys", [
        """CREATE TABLE api_keys (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            key_hash TEXT NOT NULL UNIQUE,      -- sha256 hex of the secret; the secret is never stored
            key_prefix TEXT NOT NULL,           -- first characters of the secret, to recognise it in lists
            role TEXT NOT NULL,                 -- 'admin' or 'user'
            models TEXT,                        -- JSON list of allowed model names; NULL: all models
            rpm INTEGER,
            tpm INTEGER,
            token_budget {bigint},              -- lifetime prompt+completion tokens; NULL: unlimited
            tokens_used {bigint} NOT NULL DEFAULT 0,
            created_at {real} NOT NULL,         -- unix seconds
            revoked_at {real}
        )""",
    ]),
    (2, "usage and audit rows", [
        """CREATE TABLE usage_records (
            id {pk},
            created_at {real} NOT NULL,         -- unix seconds when the request arrived
            request_id TEXT NOT NULL,
            key_id TEXT,                        -- NULL when auth is disabled
            model TEXT NOT NULL,
            replica TEXT,                       -- NULL when no replica answered (cache hit, rejected)
            endpoint TEXT NOT NULL,
            stream INTEGER NOT NULL,
            cached INTEGER NOT NULL,
            status INTEGER NOT NULL,
            prompt_tokens INTEGER NOT NULL,
            completion_tokens INTEGER NOT NULL,
            latency_ms {real} NOT NULL,
            attempts INTEGER NOT NULL
        )""",
        "CREATE INDEX usage_records_created ON usage_records (created_at)",
        "CREATE INDEX usage_records_key ON usage_records (key_id, created_at)",
    ]),
    (3, "chat page conversations and the admin audit log", [
        """CREATE TABLE ui_conversations (
            id TEXT PRIMARY KEY,
            owner TEXT NOT NULL,                -- the API key id; 'anonymous' when auth is disabled
            title TEXT NOT NULL,
            data TEXT NOT NULL,                 -- the page's JSON document: message tree and settings
            size_bytes INTEGER NOT NULL,
            created_at {real} NOT NULL,         -- unix seconds
            updated_at {real} NOT NULL
        )""",
        "CREATE INDEX ui_conversations_owner ON ui_conversations (owner, updated_at)",
        """CREATE TABLE admin_audit (
            id {pk},
            created_at {real} NOT NULL,         -- unix seconds
            actor_key_id TEXT NOT NULL,         -- the admin key that acted
            action TEXT NOT NULL,               -- 'key.create', 'key.update', 'key.revoke'
            target TEXT NOT NULL,               -- the id acted on
            detail TEXT NOT NULL                -- JSON: the fields set (never a secret)
        )""",
        "CREATE INDEX admin_audit_created ON admin_audit (created_at)",
    ]),
    (4, "key teams (the tenant that shares a cache scope and prefix-cache salt)", [
        "ALTER TABLE api_keys ADD COLUMN team TEXT",
    ]),
    (5, "priority tiers of keys, and batches created through the gateway", [
        """CREATE TABLE key_scheduling (
            key_id TEXT PRIMARY KEY,            -- an api_keys id (or the bootstrap admin's)
            tier TEXT NOT NULL,                 -- a name from the config's scheduling.tiers
            weight {real} NOT NULL,             -- fair-share weight within the tier (1 = equal)
            updated_at {real} NOT NULL
        )""",
        """CREATE TABLE gateway_batches (
            batch_id TEXT PRIMARY KEY,          -- the upstream server's batch id
            key_id TEXT,                        -- the key that created it; NULL when auth is disabled
            created_at {real} NOT NULL,
            charged_at {real}                   -- when its usage was charged to the key (once)
        )""",
    ]),
    (6, "stored Responses API responses: which replica holds each, for which tenant", [
        """CREATE TABLE response_routes (
            response_id TEXT PRIMARY KEY,       -- the replica's id of the stored response
            tenant TEXT NOT NULL,               -- kvik.gateway.tenancy.tenant_of the key that made it
            model TEXT NOT NULL,                -- the gateway's model name it was made with
            replica TEXT NOT NULL,              -- the replica's URL; only it stores the conversation
            created_at {real} NOT NULL          -- unix seconds
        )""",
        "CREATE INDEX response_routes_created ON response_routes (created_at)",
    ]),
    (7, "the tokens a stored response's conversation holds, reserved when a request continues it", [
        # input + output tokens of the stored response, as its replica counted them: what a request
        # with previous_response_id is prompted with besides its own input (kvik.gateway.tokens)
        "ALTER TABLE response_routes ADD COLUMN context_tokens INTEGER NOT NULL DEFAULT 0",
    ]),
]


def migrate(db: Database) -> list[int]:
    """Apply pending migrations; return the versions applied now."""
    types = TYPES[db.dialect]
    applied_now = []
    with db.transaction():
        db.execute(f"CREATE TABLE IF NOT EXISTS kvik_schema_migrations (version INTEGER PRIMARY KEY, "
                   f"description TEXT NOT NULL, applied_at {types['real']} NOT NULL)")
        # Read inside the transaction: a concurrent migrator may have finished while we waited.
        done = {row["version"] for row in db.fetchall("SELECT version FROM kvik_schema_migrations")}
        for version, description, statements in MIGRATIONS:
            if version in done:
                continue
            for statement in statements:
                db.execute(statement.format(**types))
            db.execute("INSERT INTO kvik_schema_migrations (version, description, applied_at) VALUES (?, ?, ?)",
                       (version, description, time.time()))
            applied_now.append(version)
    return applied_now


def schema_version(db: Database) -> int:
    row = db.fetchone("SELECT MAX(version) AS version FROM kvik_schema_migrations")
    return int(row["version"] or 0) if row else 0
