"""`AsyncEngine`: the engine on its own thread, with an asyncio streaming facade.

The engine loop runs in a dedicated thread so a step (tens of milliseconds of torch work, which
releases the GIL) never blocks the HTTP event loop. Requests and aborts reach it through a command
queue; outputs go back to each request's asyncio.Queue with `call_soon_threadsafe`. `generate()`
aborts its request when the consumer stops early (a client that disconnects), and the engine thread
frees the request's blocks before its next step.

If a step raises (a bug, or an out-of-memory on the device), every in-flight request receives the
error, the engine frees their blocks, and the loop keeps serving new requests.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from kvik.core.config import EngineArgs
from kvik.core.outputs import RequestOutput
from kvik.core.sampling_params import SamplingParams
from kvik.engine.llm_engine import EngineStats, LLMEngine

logger = logging.getLogger("kvik.engine")


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any]

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}  # touched by the engine thread only
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()
        self.steps = 0

    @classmethod
    def from_args(cls, args: EngineArgs) -> AsyncEngine:
        return cls(LLMEngine(args))

    # -- lifecycle --

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvik-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        """The snapshot taken after the engine's last step (safe from any thread)."""
        return self._stats

    @property
    def num_unfinished_requests(self) -> int:
        stats = self._stats
        return stats.num_running + stats.num_waiting + self._commands.qsize()

    # -- requests --

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as the engine produces them (in `params.output_kind`)."""
        self.start()
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._commands.put(("add", request_id, prompt, params, arrival_time or time.time(), stream))
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wakeup.set()

    # -- the engine thread --

    def _run(self) -> None:
        while not self._stop.is_set():
            self._apply_commands()
            if not self.engine.has_unfinished_requests():
                self._stats = self.engine.stats()
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - keep serving; fail only the affected requests
                logger.exception("engine step failed; failing %d in-flight request(s)", len(self._streams))
                self._fail_all(exc)
                continue
            self.steps += 1
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    stream.put(output)
                    if output.finished:
                        del self._streams[output.request_id]
            self._stats = self.engine.stats()

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request_id, prompt, params, arrival_time, stream = command
                try:
                    self.engine.add_request(request_id, prompt, params, arrival_time=arrival_time)
                except Exception as exc:  # noqa: BLE001 - a bad request fails alone
                    stream.put(exc)
                    continue
                self._streams[request_id] = stream
            else:
                request_id = command[1]
                self.engine.abort_request(request_id)
                self._streams.pop(request_id, None)

    def _fail_all(self, exc: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            stream.put(exc)
        self._streams.clear()
        for request_id in list(self.engine.groups):
            self.engine.abort_request(request_id)
        self._stats = self.engine.stats()
