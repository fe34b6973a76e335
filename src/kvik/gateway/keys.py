"""API keys: what a key is, how a secret is made and how it is stored.

A secret is `kvik-` plus 43 URL-safe characters (256 random bits). Only its SHA-256 is stored: with
that much entropy a fast hash is safe (nothing to brute-force), and lookups stay a single indexed
query instead of a deliberately slow password hash on every request. The `kvik-` prefix makes
leaked keys recognisable to secret scanners.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvik.core.errors import InvalidRequestError, NotFoundError
from kvik.gateway.storage.database import Database, Row

SECRET_PREFIX = "kvik-"
ROLES = ("user", "admin")
_DISPLAY_PREFIX_CHARS = 12
UPDATABLE_FIELDS = ("name", "models", "rpm", "tpm", "token_budget", "team")
# Limits and budgets are stored as 64-bit integers and travel as JSON numbers: keep them exact in both.
MAX_LIMIT = 2**53 - 1


@dataclass(slots=True)
class ApiKey:
    id: str
    name: str
    key_prefix: str  # the first characters of the secret, safe to show
    role: str  # "user" or "admin"
    models: list[str] | None  # allowed model names; None allows every model
    rpm: int | None
    tpm: int | None
    token_budget: int | None
    tokens_used: int
    created_at: float
    revoked_at: float | None = None
    # Keys of one team are one tenant: they share response-cache entries and the prefix-cache salt.
    team: str | None = None

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    def allows_model(self, model: str) -> bool:
        return self.models is None or model in self.models

    def to_public_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True, frozen=True)
class NewKey:
    key: ApiKey
    secret: str  # shown once, never stored


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class KeyStore:
    """Create, list, revoke and look up keys. Synchronous: the server calls it via `to_thread`."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def create(self, name: str, *, role: str = "user", models: list[str] | None = None,
               rpm: int | None = None, tpm: int | None = None, token_budget: int | None = None,
               team: str | None = None) -> NewKey:
        _validate(name, role, models, rpm, tpm, token_budget, team)
        secret = SECRET_PREFIX + secrets.token_urlsafe(32)
        key = ApiKey(id="key_" + secrets.token_hex(8), name=name, key_prefix=secret[:_DISPLAY_PREFIX_CHARS],
                     role=role, models=models, rpm=rpm, tpm=tpm, token_budget=token_budget, tokens_used=0,
                     created_at=time.time(), team=team)
        self._db.execute(
            "INSERT INTO api_keys (id, name, key_hash, key_prefix, role, models, rpm, tpm, token_budget, "
            "tokens_used, created_at, team) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (key.id, name, hash_secret(secret), key.key_prefix, role,
             None if models is None else json.dumps(models), rpm, tpm, token_budget, 0, key.created_at, team))
        return NewKey(key=key, secret=secret)

    def list(self, *, include_revoked: bool = False) -> list[ApiKey]:
        where = "" if include_revoked else " WHERE revoked_at IS NULL"
        rows = self._db.fetchall(f"SELECT * FROM api_keys{where} ORDER BY created_at, id")
        return [_from_row(row) for row in rows]

    def get(self, key_id: str) -> ApiKey:
        row = self._db.fetchone("SELECT * FROM api_keys WHERE id = ?", (key_id,))
        if row is None:
            raise NotFoundError(f"No API key with id {key_id!r}.", param="id")
        return _from_row(row)

    def revoke(self, key_id: str) -> ApiKey:
        if not self._db.execute("UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                                (time.time(), key_id)):
            self.get(key_id)  # raises NotFoundError when the id is unknown; else it was already revoked
        return self.get(key_id)

    def lookup(self, secret: str) -> ApiKey | None:
        """The live key with this secret, or None (unknown or revoked)."""
        row = self._db.fetchone("SELECT * FROM api_keys WHERE key_hash = ? AND revoked_at IS NULL",
                                (hash_secret(secret),))
        return None if row is None else _from_row(row)

    def update(self, key_id: str, changes: dict[str, Any]) -> ApiKey:
        """Change a live key's name, model allow-list or limits; a `None` value clears the allow-list
        or a limit. The role and the secret never change (create a new key instead)."""
        key = self.get(key_id)
        if key.revoked_at is not None:
            raise InvalidRequestError(f"The key {key_id!r} is revoked; create a new one.", param="id")
        unknown = set(changes) - set(UPDATABLE_FIELDS)
        if unknown:
            field = sorted(unknown)[0]
            raise InvalidRequestError(f"{field}: cannot be changed; change {', '.join(UPDATABLE_FIELDS)}",
                                      param=field)
        merged = {field: changes.get(field, getattr(key, field)) for field in UPDATABLE_FIELDS}
        _validate(merged["name"], key.role, merged["models"], merged["rpm"], merged["tpm"], merged["token_budget"],
                  merged["team"])
        models = merged["models"]
        self._db.execute("UPDATE api_keys SET name = ?, models = ?, rpm = ?, tpm = ?, token_budget = ?, team = ? "
                         "WHERE id = ?",
                         (merged["name"], None if models is None else json.dumps(models), merged["rpm"],
                          merged["tpm"], merged["token_budget"], merged["team"], key_id))
        return self.get(key_id)

    def add_tokens_used(self, totals: dict[str, int]) -> None:
        self._db.executemany("UPDATE api_keys SET tokens_used = tokens_used + ? WHERE id = ?",
                             [(tokens, key_id) for key_id, tokens in totals.items() if tokens])


def _validate(name: str, role: str, models: list[str] | None, rpm: int | None, tpm: int | None,
              token_budget: int | None, team: str | None) -> None:
    if not _is_text(name):
        raise InvalidRequestError("name: give a name of 1 to 200 characters", param="name")
    if team is not None and not _is_text(team):
        raise InvalidRequestError("team: give a team name of 1 to 200 characters, or null", param="team")
    if role not in ROLES:
        raise InvalidRequestError(f"role: {role!r} is not one of {', '.join(ROLES)}", param="role")
    if models is not None and (not isinstance(models, list) or not all(_is_text(m) for m in models)):
        raise InvalidRequestError("models: give a list of model names", param="models")
    for field, value in (("rpm", rpm), ("tpm", tpm), ("token_budget", token_budget)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_LIMIT):
            raise InvalidRequestError(f"{field}: must be an integer from 1 to {MAX_LIMIT}, or null", param=field)


def _is_text(value: object) -> bool:
    """1 to 200 characters that have a UTF-8 encoding (JSON allows lone surrogates; SQL does not)."""
    if not isinstance(value, str) or not 1 <= len(value) <= 200:
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def _from_row(row: Row) -> ApiKey:
    return ApiKey(id=row["id"], name=row["name"], key_prefix=row["key_prefix"], role=row["role"],
                  models=None if row["models"] is None else json.loads(row["models"]),
                  rpm=row["rpm"], tpm=row["tpm"], token_budget=row["token_budget"],
                  tokens_used=int(row["tokens_used"]), created_at=float(row["created_at"]),
                  revoked_at=None if row["revoked_at"] is None else float(row["revoked_at"]),
                  team=row.get("team"))
