"""Streamed completions through the gateway in a background thread, with bounded concurrency, each
checked to its end: HTTP 200, a chunk with a `finish_reason`, and the closing `data: [DONE]`. The
rollout, discovery and drain tests run one while they change the replica set under it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx


@dataclass(slots=True)
class StreamOutcome:
    status: int
    finish_reason: str | None = None
    done: bool = False  # saw `data: [DONE]`
    chunks: int = 0
    error: str | None = None  # a transport error, an error event, or the error body

    @property
    def complete(self) -> bool:
        return self.status == 200 and self.finish_reason is not None and self.done and self.error is None


class StreamLoad:
    """`total` streamed /v1/completions (or until `stop()`), `concurrency` at a time."""

    def __init__(self, url: str, key: str, *, model: str = "tiny", total: int = 200, concurrency: int = 16,
                 max_tokens: int = 16, timeout_s: float = 120.0) -> None:
        self.url, self.key, self.model = url, key, model
        self.total, self.concurrency, self.max_tokens, self.timeout_s = total, concurrency, max_tokens, timeout_s
        self.outcomes: list[StreamOutcome] = []
        self.started = 0
        self.allowed = total  # requests that may start before `allow` raises it (see `allow`)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="stream-load", daemon=True)

    def start(self) -> StreamLoad:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Send no more requests (the ones in flight finish)."""
        self._stop.set()

    def allow(self, count: int) -> None:
        """Start no more than `count` requests until this is called again with a higher count: keeps
        part of the load back for a later phase of a test however fast the machine runs."""
        self.allowed = min(count, self.total)

    def wait_started(self, count: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.started < count:
            assert self._thread.is_alive(), "the load ended early"
            assert time.monotonic() < deadline, f"only {self.started} of {count} requests started"
            time.sleep(0.02)

    def join(self, timeout: float = 300.0) -> list[StreamOutcome]:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the load did not finish in time"
        return self.outcomes

    def failures(self) -> list[StreamOutcome]:
        return [outcome for outcome in self.outcomes if not outcome.complete]

    async def _run(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}"}
        limits = httpx.Limits(max_connections=self.concurrency)
        async with httpx.AsyncClient(base_url=self.url, headers=headers, timeout=self.timeout_s, limits=limits) as client:
            await asyncio.gather(*(self._worker(client, worker) for worker in range(self.concurrency)))

    async def _worker(self, client: httpx.AsyncClient, worker: int) -> None:
        while not self._stop.is_set() and self.started < self.total:
            if self.started >= self.allowed:
                await asyncio.sleep(0.01)
                continue
            number = self.started
            self.started += 1  # one event loop thread: no race between workers
            self.outcomes.append(await self._one(client, f"load {worker} {number}"))

    async def _one(self, client: httpx.AsyncClient, prompt: str) -> StreamOutcome:
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream": True}
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                outcome = StreamOutcome(response.status_code)
                if response.status_code != 200:
                    outcome.error = (await response.aread()).decode(errors="replace")
                    return outcome
                async for line in _sse_lines(response):
                    if not line.startswith(b"data: "):
                        continue
                    data = line[len(b"data: "):]
                    if data == b"[DONE]":
                        outcome.done = True
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        outcome.error = json.dumps(event["error"])
                    outcome.chunks += 1
                    for choice in event.get("choices") or []:
                        outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
                return outcome
        except (httpx.HTTPError, ValueError) as exc:
            return StreamOutcome(0, error=f"{type(exc).__name__}: {exc}")


async def _sse_lines(response: httpx.Response) -> AsyncIterator[bytes]:
    """SSE lines split at LF only: generated text may hold U+2028 and other characters that
    str.splitlines (and so httpx's aiter_lines) would split a JSON event at."""
    buffer = b""
    async for chunk in response.aiter_bytes():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
    if buffer:
        yield buffer.rstrip(b"\r")
