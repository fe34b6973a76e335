"""What the server knows: its configuration, the engine (once loaded), readiness and admission.

Admission control is a counter of sequences the server has handed to the engine and not yet seen
finish. It lives on the event loop thread, so it is exact without locks: a request is refused with
503 + Retry-After when running slots plus `max_waiting` are taken, before any work is done for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from kvik.core.errors import ModelNotFoundError, ServiceUnavailableError
from kvik.engine.async_engine import AsyncEngine
from kvik.engine.llm_engine import EngineStats
from kvik.server.metrics import ServerMetrics

logger = logging.getLogger("kvik.server")


@dataclass(slots=True)
class ServerConfig:
    served_model_names: list[str]
    api_key: str | None = None
    max_waiting: int = 256  # sequences allowed to queue beyond the running batch
    drain_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    max_body_bytes: int = 16 * 2**20
    log_prompts: bool = False
    max_num_seqs: int = 64


@dataclass(eq=False)
class ServerState:
    config: ServerConfig
    engine: AsyncEngine | None = None
    ready: bool = False
    draining: bool = False
    load_error: BaseException | None = None
    active_sequences: int = 0
    in_flight_requests: int = 0
    metrics: ServerMetrics = field(init=False)
    idle: asyncio.Event | None = None
    started: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.config.served_model_names[0], self.engine_stats)

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]

    def engine_stats(self) -> EngineStats | None:
        return self.engine.stats() if self.engine is not None else None

    def resolve_model(self, requested: str | None) -> str:
        if requested is None or requested in self.config.served_model_names:
            return requested or self.model_name
        raise ModelNotFoundError(
            f"The model {requested!r} does not exist; this server serves "
            f"{', '.join(repr(n) for n in self.config.served_model_names)}", param="model")

    def require_engine(self) -> AsyncEngine:
        if self.draining:
            raise ServiceUnavailableError("the server is shutting down; retry on another replica",
                                          retry_after=5, code="draining")
        if not self.ready or self.engine is None:
            raise ServiceUnavailableError("the model is still loading; retry shortly", retry_after=5,
                                          code="loading")
        return self.engine

    def admit(self, num_sequences: int) -> None:
        """Reserve capacity for `num_sequences` or refuse with 503 + Retry-After."""
        limit = self.config.max_num_seqs + self.config.max_waiting
        if self.active_sequences + num_sequences > limit:
            self.metrics.rejected("overloaded")
            raise ServiceUnavailableError(
                f"the server is at capacity ({self.active_sequences} sequences running or queued, "
                f"limit {limit}); retry later", retry_after=1, code="server_overloaded")
        self.active_sequences += num_sequences

    def release(self, num_sequences: int) -> None:
        self.active_sequences -= num_sequences

    def request_started(self) -> None:
        self.in_flight_requests += 1

    def request_finished(self) -> None:
        self.in_flight_requests -= 1
        if self.in_flight_requests == 0 and self.idle is not None:
            self.idle.set()
