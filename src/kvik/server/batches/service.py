"""The Batch API's logic behind its routes: files and batches in OpenAI's shapes, per owner.

The owner is the tenant the request carries in `X-Kvik-Tenant` (set by the gateway from the API key;
'' when the server is used directly): a caller sees only its own files and batches, anything else is
404, as an unknown id. The database opens on first use (or at start when it already exists, so
batches left running resume), so a server that never sees a batch writes nothing.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from kvik.core.errors import InvalidRequestError, NotFoundError, ServiceUnavailableError
from kvik.server.batches.config import BatchConfig
from kvik.server.batches.input_file import ENDPOINTS, parse_input_file
from kvik.server.batches.lines import LineServings
from kvik.server.batches.runner import BatchRunner
from kvik.server.batches.store import BatchStore
from kvik.server.state import ServerState

logger = logging.getLogger("kvik.server.batches")

TENANT_HEADER = "x-kvik-tenant"
TENANT_WEIGHT_HEADER = "x-kvik-tenant-weight"
MAX_METADATA_PAIRS = 16
_WINDOW = re.compile(r"^(\d{1,6})([smhd])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_WINDOW_S = 7 * 86400


@dataclass(slots=True, frozen=True)
class Caller:
    tenant: str
    tenant_weight: float = 1.0


def caller_from_headers(headers: Any) -> Caller:
    tenant = (headers.get(TENANT_HEADER) or "").strip()
    if len(tenant) > 256:
        raise InvalidRequestError(f"{TENANT_HEADER}: at most 256 characters")
    raw_weight = headers.get(TENANT_WEIGHT_HEADER)
    weight = 1.0
    if raw_weight:
        try:
            weight = float(raw_weight)
        except ValueError:
            weight = -1.0
        if not 0 < weight <= 1000:
            raise InvalidRequestError(f"{TENANT_WEIGHT_HEADER}: give a number in (0, 1000]")
    return Caller(tenant, weight)


class BatchService:
    def __init__(self, state: ServerState, config: BatchConfig, servings: LineServings) -> None:
        self.state = state
        self.servings = servings
        self.config = config
        self.store: BatchStore | None = None
        self.runner: BatchRunner | None = None

    async def start(self) -> None:
        """Open the database now if it exists (its unfinished batches resume)."""
        if self.config.db_path is not None and self.config.db_path.exists():
            self._open()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.stop()
        if self.store is not None:
            self.store.close()

    def _open(self) -> BatchStore:
        if self.store is None:
            if self.config.db_path is None:
                raise NotFoundError("the Batch API is off on this server (started with --batch-db none)")
            self.store = BatchStore(self.config.db_path)
            self.runner = BatchRunner(self.state, self.store, self.config.concurrency, self.servings)
            self.runner.start()
            logger.info("batch database: %s", self.config.db_path)
        return self.store

    # -- files --

    async def upload(self, caller: Caller, purpose: str, filename: str, content: bytes) -> dict[str, Any]:
        if purpose != "batch":
            raise InvalidRequestError(f"purpose: {purpose!r} is not supported; kvik stores files for the "
                                      "Batch API (purpose 'batch')", param="purpose")
        if len(content) > self.config.max_file_bytes:
            raise InvalidRequestError(f"file: is {len(content)} bytes; the limit is {self.config.max_file_bytes}",
                                      param="file")
        lines = parse_input_file(content, self.config.max_lines)
        store = self._open()
        row = {"id": f"file-{secrets.token_hex(12)}", "owner": caller.tenant, "purpose": purpose,
               "filename": (filename or "input.jsonl")[:255], "bytes": len(content), "num_lines": len(lines),
               "created_at": int(time.time()), "content": content}
        await store.run(store.add_file, row)
        return file_object(row)

    async def get_file(self, caller: Caller, file_id: str, *, content: bool = False) -> dict[str, Any]:
        store = self._open()
        row = await store.run(lambda: store.get_file(caller.tenant, file_id, content=content))
        if row is None:
            raise NotFoundError(f"No file with id {file_id!r}.", param="file_id")
        return row

    async def list_files(self, caller: Caller, purpose: str | None, after: str | None, limit: int,
                         order: str) -> dict[str, Any]:
        if order not in ("asc", "desc"):
            raise InvalidRequestError("order: give asc or desc", param="order")
        store = self._open()
        rows = await store.run(store.list_files, caller.tenant, purpose, after, limit + 1, order == "desc")
        return page([file_object(row) for row in rows], limit)

    async def delete_file(self, caller: Caller, file_id: str) -> dict[str, Any]:
        store = self._open()
        await self.get_file(caller, file_id)
        user = await store.run(store.file_in_use, file_id)
        if user is not None:
            raise InvalidRequestError(f"file {file_id!r} is the input of batch {user!r}, which is still running; "
                                      "cancel it first", param="file_id")
        await store.run(store.delete_file, caller.tenant, file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    # -- batches --

    async def create_batch(self, caller: Caller, body: dict[str, Any]) -> dict[str, Any]:
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise InvalidRequestError(f"endpoint: {endpoint!r} is not one of {', '.join(ENDPOINTS)}", param="endpoint")
        window = completion_window_seconds(body.get("completion_window"))
        metadata = check_metadata(body.get("metadata"))
        input_file_id = body.get("input_file_id")
        if not isinstance(input_file_id, str):
            raise InvalidRequestError("input_file_id: give the id of an uploaded file", param="input_file_id")
        try:
            file_row = await self.get_file(caller, input_file_id, content=True)
        except NotFoundError as exc:
            exc.param = "input_file_id"
            raise
        if file_row["purpose"] != "batch":
            raise InvalidRequestError(f"input_file_id: file {input_file_id!r} has purpose {file_row['purpose']!r}; "
                                      "upload the input with purpose 'batch'", param="input_file_id")
        lines = parse_input_file(file_row["content"], self.config.max_lines)
        wrong = next((line for line in lines if line.url != endpoint), None)
        if wrong is not None:
            raise InvalidRequestError(f"input_file_id: line {wrong.file_line} has url {wrong.url!r} but the batch's "
                                      f"endpoint is {endpoint!r}; every line must use the batch's endpoint",
                                      param="input_file_id")
        store = self._open()
        now = int(time.time())
        row = {"id": f"batch_{secrets.token_hex(12)}", "owner": caller.tenant, "tenant_weight": caller.tenant_weight,
               "endpoint": endpoint, "input_file_id": input_file_id, "completion_window": body["completion_window"],
               "status": "validating", "total": len(lines), "created_at": now, "expires_at": now + window,
               "metadata": json.dumps(metadata) if metadata is not None else None}
        await store.run(store.add_batch, row)
        self.runner.wake()
        return await self.get_batch(caller, row["id"])

    async def get_batch(self, caller: Caller, batch_id: str) -> dict[str, Any]:
        store = self._open()
        row = await store.run(store.get_batch, batch_id, caller.tenant)
        if row is None:
            raise NotFoundError(f"No batch with id {batch_id!r}.", param="batch_id")
        return batch_object(row)

    async def cancel_batch(self, caller: Caller, batch_id: str) -> dict[str, Any]:
        store = self._open()
        batch = await self.get_batch(caller, batch_id)
        if batch["status"] in ("validating", "in_progress"):
            await store.run(lambda: store.set_status(batch_id, "cancelling", only_from=("validating", "in_progress")))
            self.runner.wake()
        elif batch["status"] not in ("cancelling", "cancelled"):
            raise InvalidRequestError(f"batch {batch_id!r} is {batch['status']}; only a running batch can be "
                                      "cancelled", param="batch_id")
        return await self.get_batch(caller, batch_id)

    async def list_batches(self, caller: Caller, after: str | None, limit: int) -> dict[str, Any]:
        store = self._open()
        rows = await store.run(store.list_batches, caller.tenant, after, limit + 1)
        return page([batch_object(row) for row in rows], limit)

    def require_enabled(self) -> None:
        if self.config.db_path is None:
            raise NotFoundError("the Batch API is off on this server (started with --batch-db none)")
        if self.state.draining:
            raise ServiceUnavailableError("the server is shutting down", retry_after=5, code="draining")


def completion_window_seconds(value: Any) -> int:
    """OpenAI's '24h'; kvik also takes other durations ('30m', '2h', '7d'), from 1 s up to 7 days."""
    match = _WINDOW.match(value) if isinstance(value, str) else None
    seconds = int(match.group(1)) * _UNIT_SECONDS[match.group(2)] if match else 0
    if not 1 <= seconds <= MAX_WINDOW_S:
        raise InvalidRequestError(f"completion_window: {value!r} is not a duration such as '24h' (1 s to 7 d)",
                                  param="completion_window")
    return seconds


def check_metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if (not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS
            or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                       for k, v in value.items())):
        raise InvalidRequestError(f"metadata: give up to {MAX_METADATA_PAIRS} string pairs (keys up to 64 "
                                  "characters, values up to 512)", param="metadata")
    return value


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "status_details": None, "expires_at": None}


def batch_object(row: dict[str, Any]) -> dict[str, Any]:
    errors = json.loads(row["errors"]) if row.get("errors") else None
    input_tokens, output_tokens = row["input_tokens"], row["output_tokens"]
    return {
        "id": row["id"], "object": "batch", "endpoint": row["endpoint"],
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
        "status": row["status"], "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
        "created_at": row["created_at"], "in_progress_at": row["in_progress_at"], "expires_at": row["expires_at"],
        "finalizing_at": row["finalizing_at"], "completed_at": row["completed_at"], "failed_at": row["failed_at"],
        "expired_at": row["expired_at"], "cancelling_at": row["cancelling_at"], "cancelled_at": row["cancelled_at"],
        "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
        "metadata": json.loads(row["metadata"]) if row.get("metadata") else None,
        "usage": {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": row["cached_tokens"]},
                  "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": input_tokens + output_tokens},
    }


def page(items: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """OpenAI's cursor page: `limit` items, with has_more when the store returned one more."""
    shown = items[:limit]
    return {"object": "list", "data": shown, "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": len(items) > limit}

