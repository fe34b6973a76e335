"""`EngineCoreClient`: the front end's handle on an engine core running in a process or a thread.

It binds two ZeroMQ sockets (inputs out, outputs in), starts the core (`kvik.engine.core_process`)
as a spawned process, or as a thread over in-process sockets (tests, embedding), waits for its
`EngineInfo`, then hands every `EngineCoreOutputs` to a callback on the event loop. It watches the
core: if the process exits or the thread ends without being told to, `on_dead` is called once with
the reason, so the front end can fail what is in flight and stop saying it is healthy.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
from typing import Any, Callable

import msgspec
import zmq
import zmq.asyncio

from kvik.core.config import EngineArgs
from kvik.core import errors
from kvik.core.errors import ConfigError, KvikError
from kvik.engine.messages import (AbortRequests, EngineCoreOutputs, EngineCoreRequest, EngineInfo,
                                  Shutdown, StartupFailed, UtilityCall, UtilityResult, output_decoder,
                                  startup_decoder)

logger = logging.getLogger("kvik.engine")


class EngineStartError(ConfigError):
    """The engine core could not start; the message says why."""


# Frames handled per turn of the event loop before the rest of a backlog waits for the next turn.
_FRAMES_PER_DRAIN = 64


class EngineCoreClient:
    def __init__(self, args: EngineArgs, *, in_thread: bool = False) -> None:
        self.args = args
        self.in_thread = in_thread
        self.context = zmq.asyncio.Context()
        if in_thread:
            name = f"kvik-{os.getpid()}-{id(self)}"
            self._ipc_dir = None
            self.input_address, self.output_address = f"inproc://{name}-in", f"inproc://{name}-out"
        else:
            self._ipc_dir = tempfile.mkdtemp(prefix="kvik-engine-")  # 0700: only this user connects
            self.input_address = f"ipc://{self._ipc_dir}/in"
            self.output_address = f"ipc://{self._ipc_dir}/out"
        self.inputs = self.context.socket(zmq.PUSH)
        self.inputs.bind(self.input_address)
        # Outputs are read by a plain socket watched with loop.add_reader (_drain), not a
        # zmq.asyncio one: pyzmq's future per recv (register the FD, resolve, drop it again) was half
        # of the API server's CPU per streamed token at one request (py-spy), CPU the engine's
        # threads lose on a small machine.
        self.outputs = zmq.Context.shadow(self.context.underlying).socket(zmq.PULL)
        self.outputs.bind(self.output_address)
        self.encoder = msgspec.msgpack.Encoder()
        self.process: multiprocessing.process.BaseProcess | None = None
        self.thread: threading.Thread | None = None
        self.info: EngineInfo | None = None
        self.dead_reason: str | None = None
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_frame: Callable[[bytes], None] | None = None
        self._call_ids = itertools.count()
        self._calls: dict[int, asyncio.Future] = {}

    # -- lifecycle --

    async def start(self, on_outputs: Callable[[EngineCoreOutputs], None],
                    on_dead: Callable[[str], None]) -> EngineInfo:
        """Start the core and wait until it has loaded the model (or failed to)."""
        loop = asyncio.get_running_loop()
        if self.in_thread:
            from kvik.engine.core_process import run_engine_core

            sync_context = zmq.Context.shadow(self.context.underlying)
            self.thread = threading.Thread(
                target=run_engine_core, name="kvik-engine", daemon=True,
                args=(self.args, self.input_address, self.output_address, sync_context))
            self.thread.start()
        else:
            from kvik.engine.core_process import engine_process_main

            spawn = multiprocessing.get_context("spawn")
            self.process = spawn.Process(
                target=engine_process_main, name="kvik-engine", daemon=True,
                args=(self.args, self.input_address, self.output_address, os.getpid(),
                      logging.getLogger().getEffectiveLevel()))
            self.process.start()
        watcher_done = loop.create_future()
        threading.Thread(target=self._watch, args=(loop, watcher_done, on_dead), name="kvik-engine-watch",
                         daemon=True).start()
        first: asyncio.Future = loop.create_future()
        early: list[bytes] = []  # frames after the first, before the outputs' handler is set

        def on_startup_frame(frame: bytes) -> None:
            if first.done():
                early.append(frame)
            else:
                first.set_result(frame)

        self._on_frame = on_startup_frame
        self._loop = loop
        loop.add_reader(self.outputs.getsockopt(zmq.FD), self._drain)
        self._drain()  # the FD signals changes only: read what came before it was watched
        await asyncio.wait({first, watcher_done}, return_when=asyncio.FIRST_COMPLETED)
        if not first.done():
            first.cancel()
            self._stop_reading()
            raise EngineStartError(f"the engine exited while starting ({self.dead_reason}); "
                                   "see the log above")
        message = startup_decoder().decode(first.result())
        if isinstance(message, StartupFailed):
            self._stopping = True
            self._stop_reading()
            raise EngineStartError(message.message)
        self.info = message
        decoder = output_decoder()
        self._on_frame = lambda frame: self._dispatch(decoder.decode(frame), on_outputs)
        for frame in early:
            self._on_frame(frame)
        return message

    def _drain(self) -> None:
        """Handle the frames waiting on the outputs socket, up to _FRAMES_PER_DRAIN per turn (called by
        the loop when its FD fires, and again by itself while a backlog lasts)."""
        # Asking first is cheaper than the zmq.Again a recv on an empty socket raises; small
        # messages are cheaper copied to bytes than wrapped in a zmq.Frame.
        for _ in range(_FRAMES_PER_DRAIN):
            if self.outputs.closed or not self.outputs.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            frame = self.outputs.recv(zmq.NOBLOCK)
            try:
                self._on_frame(frame)
            except Exception:  # noqa: BLE001 - one bad frame must not leave the rest unread
                logger.exception("reading engine outputs failed")
        # A long backlog is read in turns, so the streams it fills get to write in between. The FD
        # will not fire again for frames already waiting: the next turn is scheduled here.
        self._loop.call_soon(self._drain)

    def _stop_reading(self) -> None:
        if self._loop is not None and not self._loop.is_closed() and not self.outputs.closed:
            self._loop.remove_reader(self.outputs.getsockopt(zmq.FD))

    def _watch(self, loop: asyncio.AbstractEventLoop, done: asyncio.Future,
               on_dead: Callable[[str], None]) -> None:
        """Wait for the core to end; if nobody asked it to, report it dead (on the loop)."""
        if self.process is not None:
            self.process.join()
            reason = f"engine process {self.process.pid} exited with code {self.process.exitcode}"
        else:
            self.thread.join()
            reason = "the engine thread ended"

        def report() -> None:
            self.dead_reason = self.dead_reason or reason
            if not done.done():
                done.set_result(None)
            for future in self._calls.values():
                if not future.done():
                    future.set_exception(KvikError(f"the engine is not running ({reason})"))
            if not self._stopping:
                logger.error("%s", reason)
                on_dead(reason)

        try:
            loop.call_soon_threadsafe(report)
        except RuntimeError:  # the loop is closed: the server is gone anyway
            pass

    def _dispatch(self, message: EngineCoreOutputs, on_outputs: Callable[[EngineCoreOutputs], None]) -> None:
        if message.utility is not None:
            future = self._calls.pop(message.utility.call_id, None)
            if future is not None and not future.done():
                if message.utility.error:
                    future.set_exception(utility_error(message.utility))
                else:
                    future.set_result(message.utility.result)
        try:
            on_outputs(message)
        except Exception:  # noqa: BLE001 - a front-end bug must not stop the reader
            logger.exception("processing engine outputs failed")

    @property
    def alive(self) -> bool:
        if self.process is not None:
            return self.process.is_alive()
        return self.thread is not None and self.thread.is_alive()

    async def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        if self.alive:
            try:
                await self.inputs.send(self.encoder.encode(Shutdown()))
            except zmq.ZMQError:
                pass
        worker = self.process or self.thread
        if worker is not None:
            await asyncio.get_running_loop().run_in_executor(None, worker.join, timeout)
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(1)
        self._stop_reading()
        self.inputs.close(linger=0)
        self.outputs.close(linger=0)
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    # -- requests --

    async def add_request(self, request: EngineCoreRequest) -> None:
        await self.inputs.send(self.encoder.encode(request), copy=False)

    async def abort(self, targets: list[tuple[str, int]]) -> None:
        if targets and self.alive:
            await self.inputs.send(self.encoder.encode(AbortRequests(targets)))

    async def call(self, method: str, *args: Any) -> Any:
        """Run a utility method on the core (reset_prefix_cache, stats) and return its result."""
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        await self.inputs.send(self.encoder.encode(UtilityCall(call_id, method, list(args))))
        return await future


def utility_error(result: UtilityResult) -> KvikError:
    """The typed error a utility call raised in the core (a plain KvikError for anything else)."""
    cls = getattr(errors, result.error_type or "", None)
    if not (isinstance(cls, type) and issubclass(cls, KvikError)):
        cls = KvikError
    return cls(result.error or "engine utility call failed", param=result.error_param)
