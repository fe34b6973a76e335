"""Start the server: listen at once (health says 503 while loading), start the engine core in its
own process and wait for it to load and warm up the model, then report ready.

SIGTERM drains in two steps. First the drain is announced for `--drain-announce-seconds`: /health
answers 503 "draining" and every response carries `x-kvik-draining`, but requests are still served,
so the kvik gateway (or any balancer probing /health) takes the replica out of rotation before it
refuses anything. Then new requests get 503, in-flight requests finish (up to the drain timeout),
the engine is shut down, and the process exits 0. SIGINT (Ctrl-C) skips the announce. If the engine process dies, health
turns 503, requests in flight end with an error, and the server exits 1 so that its supervisor
(systemd, Kubernetes, the gateway's operator) restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType
from typing import Any

import uvicorn

from kvik.core.config import EngineArgs
from kvik.core.errors import ConfigError, KvikError
from kvik.core.memory import freeze_startup_objects
from kvik.engine.async_llm import AsyncLLM
from kvik.engine.core_client import EngineStartError
from kvik.engine.preprocess_pool import PreprocessConfig
from kvik.server.app import create_app
from kvik.server.state import ServerState
from kvik.web.client_limits import guarded_h11_protocol

logger = logging.getLogger("kvik.server")

# Time given to requests that just failed because the engine died to send their error, before exit.
DEAD_ENGINE_EXIT_DELAY = 1.0


class EngineServer(uvicorn.Server):
    """uvicorn, with the engine's lifecycle attached and SIGTERM/SIGINT turned into a drain."""

    def __init__(self, config: uvicorn.Config, state: ServerState, engine_args: EngineArgs, *,
                 engine_in_thread: bool = False, preprocess: PreprocessConfig | None = None,
                 grpc_port: int | None = None) -> None:
        super().__init__(config)
        self.grpc_port = grpc_port  # also serve kvik.server.grpc on this port (same host) when set
        self.state = state
        self.engine_args = engine_args
        self.engine_in_thread = engine_in_thread
        self.preprocess = preprocess
        self.loop: asyncio.AbstractEventLoop | None = None
        self.exit_code = 0

    async def serve(self, sockets=None) -> None:  # type: ignore[override]
        self.loop = asyncio.get_running_loop()
        grpc_frontend = await self._start_grpc() if self.grpc_port is not None else None
        if self.should_exit:
            return
        starting = self.loop.create_task(self._start_engine())
        batches = self.config.app.state.batches
        await batches.start()  # batches left unfinished by the last run resume
        try:
            await super().serve(sockets)
        finally:
            starting.cancel()
            if grpc_frontend is not None:  # after the drain: in-flight gRPC calls were counted in it
                await grpc_frontend.stop(grace_s=1.0)
            await batches.stop()
            if self.state.engine is not None:
                await self.state.engine.shutdown()
            if self.state.models is not None:
                await self.state.models.shutdown()

    async def _start_grpc(self) -> Any:
        from kvik.server.grpc.frontend import GrpcFrontend  # grpcio only when --grpc-port is given

        frontend = GrpcFrontend(self.state, self.config.host, self.grpc_port)
        try:
            await frontend.start()
        except ConfigError as exc:
            logger.error("%s", exc.message)
            self.exit_code, self.should_exit = 1, True
        return frontend

    async def _start_engine(self) -> None:
        state = self.state
        started = time.perf_counter()
        if state.models is not None:
            await self._start_pool()
            return
        engine = AsyncLLM(self.engine_args, engine_in_thread=self.engine_in_thread, preprocess=self.preprocess)
        state.engine = engine
        engine.on_dead(self._engine_died)
        try:
            info = await engine.start()
        except EngineStartError as exc:
            self._start_failed(exc)
            return
        state.lora_adapters = {adapter.name: adapter for adapter in info.lora_adapters}
        state.ready = True
        try:
            parsers = state.output_parsers()
        except KvikError as exc:  # e.g. --reasoning-parser for a model without thinking tags
            state.ready = False
            self._start_failed(exc)
            return
        logger.info("tool-call parser: %s; reasoning parser: %s",
                    parsers.tools.name if parsers.tools else "none",
                    parsers.reasoning.name if parsers.reasoning else "none")
        logger.info("ready in %.1fs: %s, max_model_len %d, %d KV blocks", time.perf_counter() - started,
                    info.architecture, info.max_model_len, info.num_kv_blocks)
        freeze_startup_objects()

    async def _start_pool(self) -> None:
        """Several models: load the first now (so ready means something can be served); the others
        load when a request names them."""
        state, started = self.state, time.perf_counter()
        first = state.models.names[0]
        try:
            await state.models.start([first])
        except ConfigError as exc:
            self._start_failed(exc)
            return
        state.ready = True
        logger.info("ready in %.1fs: serving %s (%s loaded)", time.perf_counter() - started,
                    ", ".join(state.models.names), first)
        freeze_startup_objects()

    def _start_failed(self, exc: KvikError) -> None:
        """Start-up failed: /health says why (503) until the server exits with status 1."""
        self.state.load_error = exc
        logger.error("could not start the engine: %s", exc.message)
        self.exit_code = 1
        self.should_exit = True

    def _engine_died(self, reason: str) -> None:
        logger.error("the engine died (%s): failing requests in flight and exiting with status 1", reason)
        self.exit_code = 1
        self.loop.call_later(DEAD_ENGINE_EXIT_DELAY, setattr, self, "should_exit", True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = self.state
        if state.shutting_down or not state.ready or self.loop is None:
            super().handle_exit(sig, frame)  # second signal, or nothing to drain: stop now
            return
        announce = state.config.drain_announce if sig == signal.SIGTERM else 0.0
        if announce > 0:
            state.drain_announced = True
            logger.info("signal %d: not ready for %.1fs (still serving), then draining", sig, announce)
            self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._announce(sig, announce)))
            return
        self._begin_drain(sig)

    async def _announce(self, sig: int, seconds: float) -> None:
        await asyncio.sleep(seconds)
        if not self.should_exit:
            self._begin_drain(sig)

    def _begin_drain(self, sig: int) -> None:
        state = self.state
        state.draining = True
        logger.info("signal %d: draining %d in-flight request(s) for up to %.0fs",
                    sig, state.in_flight_requests, state.config.drain_timeout)
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.state.config.drain_timeout
        while self.state.in_flight_requests > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.state.in_flight_requests:
            logger.warning("drain timeout: %d request(s) cut off", self.state.in_flight_requests)
        self.should_exit = True


def run_server(engine_args: EngineArgs, state: ServerState, host: str, port: int,
               log_level: str = "info", *, engine_in_thread: bool = False,
               preprocess: PreprocessConfig | None = None, grpc_port: int | None = None) -> int:
    app = create_app(state)
    # The guarded protocol adds the header timeout uvicorn lacks (slowloris) and a lingering close,
    # so an early 413/408 reaches a client that is still uploading.
    http = guarded_h11_protocol(state.config.header_timeout, "--header-timeout")
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=2, lifespan="off", http=http)
    server = EngineServer(config, state, engine_args, engine_in_thread=engine_in_thread,
                          preprocess=preprocess, grpc_port=grpc_port)
    server.run()
    return server.exit_code

