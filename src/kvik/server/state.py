"""What the server knows: its configuration, the engine front end (once started), readiness and
admission.

Admission control is a counter of sequences the server has handed to the engine and not yet seen
finish. It lives on the event loop thread, so it is exact without locks: a request is refused with
503 + Retry-After when running slots plus `max_waiting` are taken, before any work is done for it,
and with 400 when it alone asks for more sequences than the server could ever hold.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from dataclasses import dataclass, field

from kvik.core.errors import InvalidRequestError, ModelNotFoundError, ServiceUnavailableError
from kvik.core.tiers import DEFAULT_TIERS
from kvik.engine.async_llm import AsyncLLM, EngineDeadError
from kvik.engine.messages import EngineStats, LoRAAdapterInfo
from kvik.engine.preprocess_pool import PreprocessPool
from kvik.server.batches.config import BatchConfig
from kvik.server.metrics import ServerMetrics
from kvik.server.model_pool import ModelPool
from kvik.server.reasoning import ReasoningParser, resolve_reasoning_parser
from kvik.server.tool_parsers import DEFAULT_PARSER, TokenVocabulary, ToolParser, resolve_tool_parser

logger = logging.getLogger("kvik.server")

# On /health and every response once SIGTERM came: the kvik gateway stops routing to this replica
# the moment it sees it (before the server refuses anything).
DRAIN_HEADER = "x-kvik-draining"


@dataclass(slots=True)
class ServerConfig:
    served_model_names: list[str]
    api_key: str | None = None
    # Bearer key of the admin endpoints (runtime LoRA adapter loading); None turns them off.
    admin_api_key: str | None = None
    max_waiting: int = 256  # sequences allowed to queue beyond the running batch
    drain_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM (after the announce)
    # Seconds after SIGTERM during which the server still serves but says it is leaving (/health 503
    # "draining", `x-kvik-draining` on every response), so balancers stop routing to it first.
    drain_announce: float = 6.0
    max_body_bytes: int = 16 * 2**20
    body_read_timeout: float = 30.0  # seconds a client may take to send its whole body
    header_timeout: float = 10.0  # seconds from a request's first byte to the end of its headers
    log_prompts: bool = False
    max_num_seqs: int = 64
    trust_request_chat_template: bool = False  # let requests bring their own chat template
    tool_call_parser: str = "auto"  # a name in kvik.server.tool_parsers, "auto" or "none"
    reasoning_parser: str = "auto"  # a name in kvik.server.reasoning, "auto" or "none"
    # Names of priority values, for metrics labels and the Batch API's background tier.
    tiers: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_TIERS))
    batch: BatchConfig = field(default_factory=lambda: BatchConfig(db_path=None))
    # SQLite file of stored Responses API responses (`:memory:`: kept only while the server runs).
    responses_store: str = ":memory:"
    responses_retention_s: float = 30 * 86400.0  # how long a stored response is kept; 0: until deleted


@dataclass(slots=True)
class OutputParsers:
    """The model's tool-call format and reasoning parser, resolved once the tokenizer is known."""

    tools: ToolParser | None
    tool_fallback: ToolParser  # writes forced calls when `tools` is None
    reasoning: ReasoningParser | None


@dataclass(eq=False)
class ServerState:
    config: ServerConfig
    engine: AsyncLLM | None = None
    models: ModelPool | None = None  # several models loaded on demand (then `engine` stays None)
    ready: bool = False
    draining: bool = False  # refusing new requests (503 "draining"), finishing the ones in flight
    drain_announced: bool = False  # leaving soon: still serving, but not ready (see ServerConfig.drain_announce)
    load_error: BaseException | None = None
    active_sequences: int = 0
    in_flight_requests: int = 0
    metrics: ServerMetrics = field(init=False)
    idle: asyncio.Event | None = None
    started: int = field(default_factory=lambda: int(time.time()))
    # Per engine (several models may have different templates); dropped with an unloaded engine.
    parsers: weakref.WeakKeyDictionary[AsyncLLM, OutputParsers] = field(default_factory=weakref.WeakKeyDictionary)
    # LoRA adapters the engine serves (--enable-lora), by name: a request's `model` may name one.
    lora_adapters: dict[str, LoRAAdapterInfo] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.config.served_model_names[0], self.engine_stats, self.config.tiers)

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]

    def engine_stats(self) -> list[tuple[str, EngineStats]]:
        """The stats of every loaded model's engine, by served name."""
        if self.models is not None:
            return self.models.stats()
        return [(self.model_name, self.engine.stats())] if self.engine is not None and self.ready else []

    def served_name(self, engine: AsyncLLM) -> str:
        """The name the model behind `engine` is served as (for metrics labels)."""
        name = self.models.name_of(engine) if self.models is not None else None
        return name or self.model_name

    @property
    def shutting_down(self) -> bool:
        """Announcing a drain or draining: /health is 503 and responses carry `x-kvik-draining`."""
        return self.drain_announced or self.draining

    def preprocess_pool(self) -> PreprocessPool | None:
        """A loaded engine's worker pool, for work that needs no model (parsing large JSON bodies)."""
        engines = [self.engine] if self.engine is not None else \
            [m.engine for m in self.models.loaded()] if self.models is not None else []
        return next((engine.pool for engine in engines if engine is not None and engine.pool is not None), None)

    @property
    def engine_dead(self) -> bool:
        return self.engine is not None and self.ready and not self.engine.alive

    def resolve_model(self, requested: str | None) -> str:
        if requested is None or requested in self.config.served_model_names or requested in self.lora_adapters:
            return requested or self.model_name
        served = [*self.config.served_model_names, *self.lora_adapters]
        raise ModelNotFoundError(
            f"The model {requested!r} does not exist; this server serves "
            f"{', '.join(repr(n) for n in served)}", param="model")

    def lora_name(self, model: str) -> str | None:
        """The LoRA adapter a resolved model name stands for, or None for a base model."""
        return model if model in self.lora_adapters else None

    async def engine_for(self, requested: str | None) -> tuple[AsyncLLM, str]:
        """The engine serving the requested model (the default one when None) and the model's name.
        With several models it loads the model if needed and leases it to the current request
        (`kvik.server.model_pool.lease_scope`), so it is not unloaded while the request runs."""
        if self.models is None:
            engine = self.require_engine()
            return engine, self.resolve_model(requested)
        self._check_accepting()
        name = self.resolve_model(requested)
        lease = await self.models.acquire(name)
        return lease.engine, name

    def _check_accepting(self) -> None:
        if self.draining:
            raise ServiceUnavailableError("the server is shutting down; retry on another replica",
                                          retry_after=5, code="draining")
        if not self.ready:
            raise ServiceUnavailableError("the server is still starting; retry shortly", retry_after=5,
                                          code="loading")

    def require_engine(self) -> AsyncLLM:
        if self.draining:
            raise ServiceUnavailableError("the server is shutting down; retry on another replica",
                                          retry_after=5, code="draining")
        if not self.ready or self.engine is None:
            raise ServiceUnavailableError("the model is still loading; retry shortly", retry_after=5,
                                          code="loading")
        if not self.engine.alive:
            raise EngineDeadError(f"the engine stopped ({self.engine.dead_reason}); retry on another "
                                  "replica", retry_after=5)
        return self.engine

    def output_parsers(self, engine: AsyncLLM | None = None) -> OutputParsers:
        """The tool-call and reasoning parsers for `engine`'s model (default: the one model), from
        the flags or detected from its chat template and vocabulary; raises ConfigError for a parser
        the model cannot use."""
        engine = engine or self.require_engine()
        parsers = self.parsers.get(engine)
        if parsers is None:
            tokenizer = engine.tokenizer
            default = tokenizer.chat.default
            template = "\n".join(default.values()) if isinstance(default, dict) else (default or "")
            vocabulary = TokenVocabulary(tokenizer.backend.token_to_id, tokenizer.special_ids)
            parsers = self.parsers[engine] = OutputParsers(
                tools=resolve_tool_parser(self.config.tool_call_parser, template, vocabulary),
                tool_fallback=DEFAULT_PARSER(vocabulary),
                reasoning=resolve_reasoning_parser(self.config.reasoning_parser, template,
                                                   tokenizer.backend.token_to_id))
        return parsers

    @property
    def capacity(self) -> int:
        return self.config.max_num_seqs + self.config.max_waiting

    def admit(self, num_sequences: int) -> None:
        """Reserve capacity for `num_sequences` or refuse: 400 if it could never fit, else 503 +
        Retry-After while others hold it."""
        if num_sequences > self.capacity:
            raise InvalidRequestError(
                f"n: the request needs {num_sequences} sequences (n x prompts), more than this server "
                f"can hold at once ({self.capacity}); lower n or send fewer prompts", param="n")
        if self.active_sequences + num_sequences > self.capacity:
            self.metrics.rejected("overloaded")
            raise ServiceUnavailableError(
                f"the server is at capacity ({self.active_sequences} sequences running or queued, "
                f"limit {self.capacity}); retry later", retry_after=1, code="server_overloaded")
        self.active_sequences += num_sequences

    def release(self, num_sequences: int) -> None:
        self.active_sequences -= num_sequences

    def request_started(self) -> None:
        self.in_flight_requests += 1

    def request_finished(self) -> None:
        self.in_flight_requests -= 1
        if self.in_flight_requests == 0 and self.idle is not None:
            self.idle.set()
