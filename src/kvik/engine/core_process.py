"""The engine core's busy loop behind two ZeroMQ sockets, in a process (or thread) of its own.

The front end binds a PUSH socket for `EngineCoreInput`s and a PULL socket for `EngineCoreOutputs`;
this loop connects to both. Each turn it takes every waiting input (adds, aborts, utility calls),
runs one step when there is work, and sends what the step produced with the engine's stats. When
idle it blocks on the input socket, waking once a second to notice a parent that died.

The first message it sends is `EngineInfo` once the model is loaded and warmed up, or
`StartupFailed` with the reason. A step that raises fails the requests in flight (each gets an
error output) and the loop goes on; a request the core refuses fails alone.

In a process the loop ignores SIGINT/SIGTERM (the front end decides when the engine stops, after
draining) and asks Linux to kill it if the front end dies, so no engine outlives its server.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import Any

import msgspec
import zmq

from kvik.core.config import EngineArgs
from kvik.core.errors import KvikError
from kvik.core.memory import freeze_startup_objects
from kvik.engine.messages import (AbortRequests, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
                                  Shutdown, StartupFailed, UtilityCall, UtilityResult, input_decoder)

logger = logging.getLogger("kvik.engine")

IDLE_POLL_MS = 1000
UTILITY_METHODS = frozenset({"reset_prefix_cache", "stats", "add_lora", "remove_lora", "list_loras"})


def run_engine_core(args: EngineArgs, input_address: str, output_address: str,
                    context: zmq.Context | None = None, parent_pid: int | None = None) -> None:
    """Load the engine, say so, then serve inputs until told to shut down."""
    context = context or zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(output_address)
    encoder = msgspec.msgpack.Encoder()
    try:
        import torch  # here, not at the top: the API server imports this module and never loads torch

        from kvik.engine.core import EngineCore

        core = EngineCore(args)
        core.warm_up()
    except BaseException as exc:  # noqa: BLE001 - reported to the front end, then we stop
        message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
        logger.error("could not start the engine: %s", message)
        outputs.send(encoder.encode(StartupFailed(message, type(exc).__name__)))
        outputs.close(linger=2000)
        inputs.close(linger=0)
        return
    freeze_startup_objects()
    outputs.send(encoder.encode(core.info()))
    try:
        # The loop never needs autograd. Entered once here, inference mode spares every step the
        # context manager ModelRunner.execute would otherwise enter and leave (2 % of a served
        # single-stream step in py-spy samples, ~1 % timed: after the weights stream through,
        # each small Python object it touches is a cache miss).
        with torch.inference_mode():
            EngineCoreLoop(core, inputs, outputs, encoder, parent_pid).run()
    finally:
        inputs.close(linger=0)
        outputs.close(linger=1000)


class EngineCoreLoop:
    def __init__(self, core: Any, inputs: zmq.Socket, outputs: zmq.Socket, encoder: msgspec.msgpack.Encoder,
                 parent_pid: int | None) -> None:
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.encoder = encoder
        self.decoder = input_decoder()
        self.parent_pid = parent_pid
        self.poller = zmq.Poller()
        self.poller.register(inputs, zmq.POLLIN)
        self.stopping = False
        self.num_steps = 0
        # Testing aid: KVIK_FAULT_STEP=N makes step N raise, to test how a failing engine looks to
        # clients end to end (their streams must end in an error, never in a success).
        self.fault_step = int(os.environ.get("KVIK_FAULT_STEP", "0") or 0)

    def run(self) -> None:
        core = self.core
        while not self.stopping:
            busy = core.has_unfinished_requests()
            changed = self._take_inputs(timeout_ms=0 if busy else IDLE_POLL_MS)
            if self.stopping:
                return
            if core.has_unfinished_requests():
                self._step()
            elif changed:
                self._send(EngineCoreOutputs(stats=core.stats()))
            elif self.parent_pid is not None and os.getppid() != self.parent_pid:
                logger.error("the server process is gone; the engine stops")
                return

    def _take_inputs(self, timeout_ms: int) -> bool:
        """Apply every waiting input; wait up to timeout_ms for the first. True if any came."""
        if not self.poller.poll(timeout_ms):
            return False
        changed = False
        while True:
            try:
                frame = self.inputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return changed
            changed = True
            self._apply(self.decoder.decode(frame.buffer))
            if self.stopping:
                return changed

    def _apply(self, message: Any) -> None:
        core = self.core
        if isinstance(message, EngineCoreRequest):
            try:
                core.add_request(message)
            except Exception as exc:  # noqa: BLE001 - a bad request fails alone
                text = exc.message if isinstance(exc, KvikError) else f"{type(exc).__name__}: {exc}"
                self._send(EngineCoreOutputs([EngineCoreOutput(message.request_id, 0, finish_reason="error",
                                                               error=text)]))
        elif isinstance(message, AbortRequests):
            for request_id, index in message.targets:
                core.abort(request_id, index)
        elif isinstance(message, UtilityCall):
            self._send(EngineCoreOutputs(utility=self._call(message)))
        elif isinstance(message, Shutdown):
            self.stopping = True

    def _call(self, call: UtilityCall) -> UtilityResult:
        if call.method not in UTILITY_METHODS:
            return UtilityResult(call.call_id, error=f"unknown engine method {call.method!r}")
        try:
            return UtilityResult(call.call_id, getattr(self.core, call.method)(*call.args))
        except KvikError as exc:  # typed: the front end raises the same class
            return UtilityResult(call.call_id, error=exc.message, error_type=type(exc).__name__,
                                 error_param=exc.param)
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            return UtilityResult(call.call_id, error=f"{type(exc).__name__}: {exc}")

    def _step(self) -> None:
        core = self.core
        self.num_steps += 1
        try:
            if self.num_steps == self.fault_step:
                raise RuntimeError(f"injected fault at step {self.num_steps} (KVIK_FAULT_STEP)")
            outputs = core.step()
        except Exception as exc:  # noqa: BLE001 - fail what was in flight, keep serving
            logger.exception("engine step failed; failing the requests in flight")
            outputs = core.fail_all(f"generation failed: {type(exc).__name__}: {exc}")
        self._send(EngineCoreOutputs(outputs, core.stats()))

    def _send(self, message: EngineCoreOutputs) -> None:
        self.outputs.send(self.encoder.encode(message), copy=False)


def engine_process_main(args: EngineArgs, input_address: str, output_address: str, parent_pid: int,
                        log_level: int) -> None:
    """Entry point of the engine process (multiprocessing, spawn)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    if os.getppid() != parent_pid:  # the parent died before we could ask to die with it
        return
    run_engine_core(args, input_address, output_address, parent_pid=parent_pid)


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: Linux sends SIGKILL when the parent dies, even by kill -9."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        pass
