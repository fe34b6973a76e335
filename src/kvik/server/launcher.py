"""Start the server: listen at once (health says 503 while loading), load the model with progress
in a thread, warm it up with one forward, then report ready. SIGTERM drains: health and new
requests get 503, in-flight requests finish (up to the drain timeout), and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from types import FrameType

import uvicorn

from kvik.core.config import EngineArgs
from kvik.core.sampling_params import SamplingParams
from kvik.engine.async_engine import AsyncEngine
from kvik.engine.llm_engine import LLMEngine
from kvik.server.app import create_app
from kvik.server.state import ServerState

logger = logging.getLogger("kvik.server")


def build_engine(args: EngineArgs) -> AsyncEngine:
    started = time.perf_counter()
    engine = LLMEngine(args)
    # One forward through every layer before saying ready: the first step pays for lazy
    # initialisation (allocator, kernels) that a user's first request should not.
    engine.add_request("warmup", [1, 2, 3, 4], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    async_engine = AsyncEngine(engine)
    async_engine.start()
    logger.info("ready in %.1fs: %s, max_model_len %d, %d KV blocks", time.perf_counter() - started,
                engine.model_config.architecture, engine.max_model_len, engine.kv.pool.num_blocks)
    return async_engine


class DrainingServer(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT turned into a drain instead of an immediate stop."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = self.state
        if state.draining or not state.ready or self.loop is None:
            super().handle_exit(sig, frame)  # second signal, or nothing to drain: stop now
            return
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

    async def serve(self, sockets=None) -> None:  # type: ignore[override]
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)


def run_server(engine_args: EngineArgs, state: ServerState, host: str, port: int,
               log_level: str = "info") -> int:
    app = create_app(state)

    def load() -> None:
        try:
            state.engine = build_engine(engine_args)
            state.ready = True
        except BaseException as exc:  # noqa: BLE001 - reported, then the process stops
            state.load_error = exc
            logger.error("could not start the engine: %s", getattr(exc, "message", exc))
            server.should_exit = True

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=2, lifespan="off")
    server = DrainingServer(config, state)
    threading.Thread(target=load, name="kvik-loader", daemon=True).start()
    server.run()
    if state.engine is not None:
        state.engine.shutdown()
    return 1 if state.load_error is not None else 0


def install_default_signals() -> None:
    """Restore default SIGTERM handling (pytest and some launchers ignore it)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
