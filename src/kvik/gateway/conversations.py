"""The chat page's conversations, kept per API key in the gateway's database.

A conversation is an opaque JSON document to the gateway (the page's message tree and settings)
plus a title; the gateway only stores, lists, searches and deletes them, and only for the key that
owns them: another key's id answers 404, never 403, so ids reveal nothing. With auth disabled every
caller is the owner 'anonymous'.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from kvik.core.errors import InvalidRequestError, NotFoundError, RateLimitError
from kvik.gateway.storage.database import Database, Row

ANONYMOUS_OWNER = "anonymous"
MAX_TITLE_CHARS = 200
MAX_DOCUMENT_BYTES = 4 * 1024 * 1024
MAX_CONVERSATIONS_PER_OWNER = 2000
MAX_LIST = 500


@dataclass(slots=True)
class ConversationSummary:
    id: str
    title: str
    created_at: float
    updated_at: float
    size_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "object": "conversation", "title": self.title, "created_at": self.created_at,
                "updated_at": self.updated_at, "size_bytes": self.size_bytes}


class ConversationStore:
    """Synchronous, like the other stores: the routes call it through `asyncio.to_thread`."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def list(self, owner: str, *, query: str | None = None, limit: int = 100) -> list[ConversationSummary]:
        """Newest first; `query` matches the title or any text in the conversation (case-insensitive)."""
        sql = "SELECT id, title, created_at, updated_at, size_bytes FROM ui_conversations WHERE owner = ?"
        params: list[Any] = [owner]
        if query:
            pattern = "%" + _escape_like(query.lower()) + "%"
            sql += " AND (LOWER(title) LIKE ? ESCAPE '!' OR LOWER(data) LIKE ? ESCAPE '!')"
            params += [pattern, pattern]
        sql += " ORDER BY updated_at DESC, id LIMIT ?"
        params.append(max(1, min(limit, MAX_LIST)))
        return [_summary(row) for row in self._db.fetchall(sql, params)]

    def get(self, owner: str, conversation_id: str) -> dict[str, Any]:
        row = self._db.fetchone("SELECT * FROM ui_conversations WHERE id = ? AND owner = ?",
                                (conversation_id, owner))
        if row is None:
            raise NotFoundError(f"No conversation with id {conversation_id!r}.", param="id")
        return {**_summary(row).to_dict(), "data": json.loads(row["data"])}

    def create(self, owner: str, title: Any, data: Any) -> ConversationSummary:
        title, document = _check_title(title), _check_data(data)
        with self._db.transaction():
            count = self._db.fetchone("SELECT COUNT(*) AS n FROM ui_conversations WHERE owner = ?", (owner,))
            if count is not None and int(count["n"]) >= MAX_CONVERSATIONS_PER_OWNER:
                raise RateLimitError(f"This key already keeps {MAX_CONVERSATIONS_PER_OWNER} conversations; "
                                     "delete some first.", retry_after=60, code="too_many_conversations")
            now = time.time()
            summary = ConversationSummary("conv_" + secrets.token_hex(12), title, now, now, len(document))
            self._db.execute(
                "INSERT INTO ui_conversations (id, owner, title, data, size_bytes, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (summary.id, owner, title, document, len(document), now, now))
        return summary

    def update(self, owner: str, conversation_id: str, *, title: Any = None, data: Any = None) -> ConversationSummary:
        sets, params = ["updated_at = ?"], [time.time()]
        if title is not None:
            sets.append("title = ?")
            params.append(_check_title(title))
        if data is not None:
            document = _check_data(data)
            sets += ["data = ?", "size_bytes = ?"]
            params += [document, len(document)]
        changed = self._db.execute(f"UPDATE ui_conversations SET {', '.join(sets)} WHERE id = ? AND owner = ?",
                                   (*params, conversation_id, owner))
        if not changed:
            raise NotFoundError(f"No conversation with id {conversation_id!r}.", param="id")
        row = self._db.fetchone("SELECT id, title, created_at, updated_at, size_bytes FROM ui_conversations "
                                "WHERE id = ?", (conversation_id,))
        assert row is not None
        return _summary(row)

    def delete(self, owner: str, conversation_id: str) -> None:
        if not self._db.execute("DELETE FROM ui_conversations WHERE id = ? AND owner = ?", (conversation_id, owner)):
            raise NotFoundError(f"No conversation with id {conversation_id!r}.", param="id")


def _check_title(title: Any) -> str:
    if not isinstance(title, str) or not title.strip():
        raise InvalidRequestError("title: give a non-empty string", param="title")
    return title.strip()[:MAX_TITLE_CHARS]


def _check_data(data: Any) -> str:
    if not isinstance(data, dict):
        raise InvalidRequestError("data: give the conversation as a JSON object", param="data")
    document = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    if len(document.encode()) > MAX_DOCUMENT_BYTES:
        raise InvalidRequestError(f"data: the conversation is over {MAX_DOCUMENT_BYTES // 2**20} MiB; start a new one",
                                  param="data", code="conversation_too_large")
    return document


def _escape_like(text: str) -> str:
    return text.replace("!", "!!").replace("%", "!%").replace("_", "!_")


def _summary(row: Row) -> ConversationSummary:
    return ConversationSummary(id=row["id"], title=row["title"], created_at=float(row["created_at"]),
                               updated_at=float(row["updated_at"]), size_bytes=int(row["size_bytes"]))
