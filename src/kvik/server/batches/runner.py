"""The background worker that runs batches: every active batch at once, each line once.

Lines run in the background tier with the batch owner as tenant, so the engine serves them only on
capacity interactive traffic leaves idle, and batches of different owners share it fairly. At most
`concurrency` lines are in the engine at a time (all batches together), so a 50,000-line batch does
not flood the queue; lines bypass the server's admission limit, which stays for interactive clients.

Each finished line is committed with its result before the next is counted (`BatchStore`), so a
server killed mid-batch resumes on start with the lines not yet recorded. A line refused because the
server is not serving right now (loading, draining, a dead engine) is not recorded and runs again in
the next pass; a line the endpoint rejects (bad body, unknown model, too long) is recorded in the
error file with the status and error it would have had.

A batch past its `completion_window` stops: lines in flight are aborted, the ones never run are
written to the error file as `batch_expired`, and the batch ends `expired` with the results it has.
Cancelling ends it `cancelled` the same way, without error lines for the lines never run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from typing import Any

from kvik.core.errors import KvikError
from kvik.core.tiers import background_priority
from kvik.protocol.errors import error_body
from kvik.server.batches.input_file import BatchLine, parse_input_file
from kvik.server.batches.lines import LineScheduling, LineServings, execute_line
from kvik.server.batches.store import BatchStore, LineResult
from kvik.server.state import ServerState

logger = logging.getLogger("kvik.server.batches")

RETRY_DELAY_S = 1.0  # before a pass over lines that could not run (server loading, draining)
IDLE_POLL_S = 5.0  # how often the worker looks for work when nobody wakes it


class BatchRunner:
    def __init__(self, state: ServerState, store: BatchStore, concurrency: int, servings: LineServings) -> None:
        self.state = state
        self.store = store
        self.slots = asyncio.Semaphore(concurrency)
        self.servings = servings
        self.priority = background_priority(state.config.tiers)
        self._wake = asyncio.Event()
        self._running: dict[str, asyncio.Task] = {}
        self._main: asyncio.Task | None = None

    def start(self) -> None:
        self._main = asyncio.get_running_loop().create_task(self._loop())

    def wake(self) -> None:
        """A batch was created or cancelled: look now."""
        self._wake.set()

    async def stop(self) -> None:
        tasks = [t for t in (self._main, *self._running.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            for batch_id in await self.store.run(self.store.active_batch_ids):
                if batch_id not in self._running:
                    task = asyncio.get_running_loop().create_task(self._run_batch(batch_id))
                    self._running[batch_id] = task
                    task.add_done_callback(lambda _, key=batch_id: self._running.pop(key, None))
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), IDLE_POLL_S)
            except asyncio.TimeoutError:
                pass

    # -- one batch --

    async def _run_batch(self, batch_id: str) -> None:
        try:
            await self._drive(batch_id)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a bug must not stop the other batches; retried next pass
            logger.exception("batch %s: the worker failed; it will be retried", batch_id)
            await asyncio.sleep(RETRY_DELAY_S)

    async def _drive(self, batch_id: str) -> None:
        store = self.store
        batch = await store.run(store.get_batch, batch_id)
        if batch["status"] == "validating":
            await store.run(lambda: store.set_status(batch_id, "in_progress", only_from=("validating",)))
        input_file = await store.run(lambda: store.get_file(batch["owner"], batch["input_file_id"], content=True))
        if input_file is None:
            await store.run(lambda: store.set_status(batch_id, "failed", errors=json.dumps(
                [{"code": "missing_file", "message": "the input file was deleted", "line": None, "param": None}])))
            return
        lines = parse_input_file(input_file["content"], max_lines=10**9)
        scheduling = LineScheduling(self.priority, batch["owner"], batch["tenant_weight"])
        retry = False
        while True:
            batch = await store.run(store.get_batch, batch_id)
            status = batch["status"]
            if status not in ("in_progress", "cancelling", "finalizing"):
                return
            done = await store.run(store.done_lines, batch_id)
            pending = [line for line in lines if line.index not in done]
            if status == "cancelling":
                await self._finish(batch, "cancelled", lines, done, expired=False)
                return
            expired = bool(pending) and time.time() >= batch["expires_at"]
            if not pending or expired or status == "finalizing":  # finalizing: killed while finishing
                await self._finish(batch, "expired" if pending else "completed", lines, done, expired=bool(pending))
                return
            if retry:  # the last pass left lines that could not run then (server loading, draining)
                await asyncio.sleep(RETRY_DELAY_S)
                retry = False
                continue
            retry = not await self._run_lines(batch, pending, scheduling)

    async def _run_lines(self, batch: dict[str, Any], pending: list[BatchLine], scheduling: LineScheduling) -> bool:
        """Run the pending lines until they are done, the batch is cancelled or expires. True if it
        stopped for cancellation or expiry (the caller re-reads the status)."""
        batch_id = batch["id"]
        tasks: set[asyncio.Task] = set()
        stopped = False
        try:
            for line in pending:
                await self.slots.acquire()
                if await self._should_stop(batch_id, batch["expires_at"]):
                    self.slots.release()
                    stopped = True
                    break
                task = asyncio.get_running_loop().create_task(self._run_line(batch, line, scheduling))
                tasks.add(task)
                task.add_done_callback(lambda t: (tasks.discard(t), self.slots.release()))
            while tasks and not stopped:
                await asyncio.wait(set(tasks), timeout=1.0)
                stopped = await self._should_stop(batch_id, batch["expires_at"])
        finally:
            for task in list(tasks):
                task.cancel()  # aborts the line in the engine; it is not recorded and runs again if resumed
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        return stopped

    async def _should_stop(self, batch_id: str, expires_at: int) -> bool:
        if time.time() >= expires_at:
            return True
        batch = await self.store.run(self.store.get_batch, batch_id)
        return batch is None or batch["status"] != "in_progress"

    async def _run_line(self, batch: dict[str, Any], line: BatchLine, scheduling: LineScheduling) -> None:
        request_id = f"batch_req_{secrets.token_hex(12)}"
        try:
            body = await execute_line(self.state, line.url, line.body, scheduling, self.servings)
        except KvikError as exc:
            if exc.http_status == 503 or exc.http_status == 429:
                return  # not serving right now: not recorded, runs again in the next pass
            record = {"id": request_id, "custom_id": line.custom_id,
                      "response": {"status_code": exc.http_status, "request_id": request_id,
                                   "body": error_body(exc.message, exc.error_type, exc.param, exc.code)},
                      "error": None}
            await self.store.run(self.store.record_result, batch["id"], LineResult(line.index, line.custom_id,
                                                                                   False, record))
            return
        except Exception:
            # A bug, not the line's fault: recorded as the endpoint's 500, so the batch still ends
            # (an unrecorded line would be run again on every pass, forever).
            logger.exception("batch %s line %s (%s) failed", batch["id"], line.index, line.custom_id)
            record = {"id": request_id, "custom_id": line.custom_id,
                      "response": {"status_code": 500, "request_id": request_id,
                                   "body": error_body("internal error running this line; see the server log",
                                                      "server_error", None, "internal_error")},
                      "error": None}
            await self.store.run(self.store.record_result, batch["id"], LineResult(line.index, line.custom_id,
                                                                                   False, record))
            return
        usage = _usage(body)
        record = {"id": request_id, "custom_id": line.custom_id,
                  "response": {"status_code": 200, "request_id": body.get("id", request_id), "body": body},
                  "error": None}
        result = LineResult(line.index, line.custom_id, True, record,
                            input_tokens=usage[0], cached_tokens=usage[1], output_tokens=usage[2])
        await self.store.run(self.store.record_result, batch["id"], result)

    async def _finish(self, batch: dict[str, Any], status: str, lines: list[BatchLine], done: set[int],
                      *, expired: bool) -> None:
        """Write the output and error files and end the batch in `status`."""
        store, batch_id = self.store, batch["id"]
        if batch["status"] == "in_progress":
            await store.run(lambda: store.set_status(batch_id, "finalizing", only_from=("in_progress",)))
        if expired:
            for line in lines:
                if line.index not in done:
                    record = {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": line.custom_id,
                              "response": None, "error": {"code": "batch_expired", "message":
                                                          "This request could not be executed before the "
                                                          "completion window expired."}}
                    await store.run(store.record_result, batch_id, LineResult(line.index, line.custom_id, False, record))
        files = {}
        for ok, column in ((True, "output_file_id"), (False, "error_file_id")):
            records = await store.run(store.result_records, batch_id, ok)
            if records:
                files[column] = await self._write_output_file(batch, records, "output" if ok else "error")
        await store.run(lambda: store.set_status(batch_id, status, **files))
        logger.info("batch %s %s (%s)", batch_id, status, ", ".join(f"{k}={v}" for k, v in files.items()) or "no output")

    async def _write_output_file(self, batch: dict[str, Any], records: list[str], kind: str) -> str:
        content = ("\n".join(records) + "\n").encode()
        file_id = f"file-{secrets.token_hex(12)}"
        row = {"id": file_id, "owner": batch["owner"], "purpose": "batch_output",
               "filename": f"{batch['id']}_{kind}.jsonl", "bytes": len(content), "num_lines": len(records),
               "created_at": int(time.time()), "content": content}
        await self.store.run(self.store.add_file, row)
        return file_id


def _usage(body: dict[str, Any]) -> tuple[int, int, int]:
    """(input, cached input, output) tokens of a line's response: chat/completions/embeddings name
    them prompt/completion tokens, the Responses API input/output tokens."""
    usage = body.get("usage") or {}
    if "input_tokens" in usage:
        details = usage.get("input_tokens_details") or {}
        return usage["input_tokens"], details.get("cached_tokens", 0), usage.get("output_tokens", 0)
    details = usage.get("prompt_tokens_details") or {}
    return usage.get("prompt_tokens", 0), details.get("cached_tokens", 0), usage.get("completion_tokens", 0)
