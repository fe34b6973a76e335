"""Several models behind one server, loaded on demand into a memory budget (least recently used out).

Each loaded model is its own `AsyncLLM` with its own engine core process, so unloading a model is
stopping that process and its memory goes back to the system at once. A model's life:

    unloaded -> queued -> loading -> ready -> draining -> unloading -> unloaded

A request for an unloaded model starts its load and waits for it (bounded by `load_timeout`); the
other models keep serving meanwhile. Loads and unloads happen one at a time: a load first makes room,
unloading the least recently used ready models until the new one's footprint fits the budget
(`kvik.server.model_footprint`; exact once a model has been loaded). A model chosen to go first
drains: it takes no new requests (they wait to load it again later) and is stopped once the requests
it is serving have finished, so no request fails because of a swap. A model whose engine dies is
simply unloaded; the next request for it loads it again.

Requests hold a lease on their model while they run. Leases taken while serving an HTTP request are
released when its response has been sent (`lease_scope`, entered by the server's request gate), so
streaming responses keep their model loaded until their last byte.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvik.core.config import EngineArgs
from kvik.core.errors import ConfigError, InsufficientMemoryError, ServiceUnavailableError
from kvik.engine.async_llm import AsyncLLM
from kvik.engine.messages import EngineStats
from kvik.engine.preprocess_pool import PreprocessConfig

logger = logging.getLogger("kvik.server")

# A model whose load failed is not retried for this long; requests get the failure instead.
LOAD_FAILURE_HOLD_S = 10.0


class ModelState(enum.Enum):
    UNLOADED = "unloaded"
    QUEUED = "queued"  # a request wants it; waiting for its turn to load (holds no memory yet)
    LOADING = "loading"
    READY = "loaded"
    DRAINING = "draining"
    UNLOADING = "unloading"


@dataclass(slots=True)
class ModelSpec:
    name: str
    args: EngineArgs
    footprint_bytes: int  # weights + KV cache: estimated before the first load, measured after


@dataclass(eq=False)
class PooledModel:
    spec: ModelSpec
    state: ModelState = ModelState.UNLOADED
    engine: AsyncLLM | None = None
    leases: int = 0
    last_used: float = 0.0  # monotonic seconds of the last lease
    loads: int = 0
    failure: tuple[float, str] | None = None  # (monotonic time, message) of the last failed load

    @property
    def holds_memory(self) -> bool:
        return self.state not in (ModelState.UNLOADED, ModelState.QUEUED)


@dataclass(slots=True, eq=False)
class ModelLease:
    """A request's claim on a loaded model; `release` exactly once (safe to call again)."""

    model: PooledModel
    engine: AsyncLLM
    _pool: ModelPool
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._pool._release(self.model)


_request_leases: contextvars.ContextVar[list[ModelLease] | None] = contextvars.ContextVar(
    "kvik_model_leases", default=None)


@contextmanager
def lease_scope() -> Iterator[list[ModelLease]]:
    """Leases taken inside (one HTTP request, one batch line) are released on leaving."""
    leases: list[ModelLease] = []
    token = _request_leases.set(leases)
    try:
        yield leases
    finally:
        _request_leases.reset(token)
        for lease in leases:
            lease.release()


@dataclass(slots=True)
class PoolConfig:
    memory_budget: int | None = None  # bytes for all loaded models; None: unbounded
    max_loaded: int | None = None  # models loaded at once; None: unbounded
    load_timeout: float = 300.0  # seconds a request waits for its model to load
    drain_timeout: float = 120.0  # seconds a model chosen for unloading waits for its requests
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)


class ModelPool:
    def __init__(self, specs: list[ModelSpec], config: PoolConfig, *,
                 engine_factory: Callable[[EngineArgs, PreprocessConfig], AsyncLLM] | None = None) -> None:
        if not specs:
            raise ConfigError("give at least one model")
        self.config = config
        self.models = {spec.name: PooledModel(spec) for spec in specs}
        budget = config.memory_budget
        for spec in specs:
            if budget is not None and spec.footprint_bytes > budget:
                raise ConfigError(f"model {spec.name!r} needs about {spec.footprint_bytes / 2**20:.0f} MiB "
                                  f"(weights + KV cache), more than the budget of {budget / 2**20:.0f} MiB")
        self._factory = engine_factory or (lambda args, pre: AsyncLLM(args, preprocess=pre))
        self._changed = asyncio.Condition()
        self._swap_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self.num_swaps = 0  # unloads done to make room

    @property
    def names(self) -> list[str]:
        return list(self.models)

    def used_bytes(self) -> int:
        return sum(m.spec.footprint_bytes for m in self.models.values() if m.holds_memory)

    def loaded(self) -> list[PooledModel]:
        return [m for m in self.models.values() if m.state is ModelState.READY and m.engine is not None]

    def name_of(self, engine: AsyncLLM) -> str | None:
        return next((m.spec.name for m in self.models.values() if m.engine is engine), None)

    def stats(self) -> list[tuple[str, EngineStats]]:
        return [(m.spec.name, m.engine.stats()) for m in self.loaded()]

    # -- leases --

    async def acquire(self, name: str) -> ModelLease:
        """A lease on the named model, loading it first if needed (waits at most `load_timeout`).
        Inside a `lease_scope` the lease is released with the scope."""
        model = self.models[name]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.load_timeout
        async with self._changed:
            while True:
                if model.state is ModelState.READY and model.engine is not None:
                    model.leases += 1
                    model.last_used = time.monotonic()
                    lease = ModelLease(model, model.engine, self)
                    scope = _request_leases.get()
                    if scope is not None:
                        scope.append(lease)
                    return lease
                if model.state is ModelState.UNLOADED:
                    if model.failure and time.monotonic() - model.failure[0] < LOAD_FAILURE_HOLD_S:
                        raise ServiceUnavailableError(f"the model {name!r} failed to load: {model.failure[1]}",
                                                      retry_after=int(LOAD_FAILURE_HOLD_S), code="model_load_failed")
                    self._start_load(model)
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise ServiceUnavailableError(
                        f"the model {name!r} did not become available within {self.config.load_timeout:.0f} s "
                        f"(it is {model.state.value}); retry shortly", retry_after=5, code="model_loading")
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except asyncio.TimeoutError:
                    pass

    def _release(self, model: PooledModel) -> None:
        model.leases -= 1
        model.last_used = time.monotonic()
        self._notify()

    # -- loading and unloading --

    async def start(self, preload: list[str]) -> None:
        """Load `preload` now (in order); raises if one cannot load."""
        for name in preload:
            model = self.models[name]
            async with self._changed:
                self._start_load(model)
                await self._changed.wait_for(lambda: model.state in (ModelState.READY, ModelState.UNLOADED))
            if model.state is not ModelState.READY:
                raise ConfigError(f"model {name!r} failed to load: {model.failure[1] if model.failure else '?'}")

    def _start_load(self, model: PooledModel) -> None:
        """Called holding the condition, with the model unloaded."""
        model.state = ModelState.QUEUED
        model.failure = None
        task = asyncio.get_running_loop().create_task(self._load(model))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _load(self, model: PooledModel) -> None:
        engine: AsyncLLM | None = None
        try:
            async with self._swap_lock:
                await self._make_room(model)
                model.state = ModelState.LOADING
                started = time.perf_counter()
                engine = self._factory(model.spec.args, self.config.preprocess)
                info = await engine.start()
                engine.on_dead(lambda reason: self._engine_died(model, engine, reason))
                # The measured footprint replaces the estimate from now on.
                model.spec.footprint_bytes = info.weight_bytes + info.kv_cache_bytes
                model.loads += 1
                logger.info("model %s loaded in %.1fs (%.0f MiB; %.0f of %s MiB in use)", model.spec.name,
                            time.perf_counter() - started, model.spec.footprint_bytes / 2**20,
                            self.used_bytes() / 2**20, self._budget_text())
        except Exception as exc:  # noqa: BLE001 - reported to the requests waiting for this model
            message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
            logger.error("model %s failed to load: %s", model.spec.name, message)
            if engine is not None:
                await engine.shutdown()
            async with self._changed:
                model.state, model.engine = ModelState.UNLOADED, None
                model.failure = (time.monotonic(), message)
                self._changed.notify_all()
            return
        async with self._changed:
            model.state, model.engine = ModelState.READY, engine
            self._changed.notify_all()

    async def _make_room(self, model: PooledModel) -> None:
        """Unload least recently used models until `model` fits (holding the swap lock)."""
        budget, max_loaded = self.config.memory_budget, self.config.max_loaded
        while True:
            others = [m for m in self.models.values() if m is not model and m.holds_memory]
            fits_memory = budget is None or sum(m.spec.footprint_bytes for m in others) + model.spec.footprint_bytes <= budget
            fits_count = max_loaded is None or len(others) < max_loaded
            if fits_memory and fits_count:
                return
            candidates = [m for m in others if m.state is ModelState.READY]
            if not candidates:
                raise InsufficientMemoryError(
                    f"the model {model.spec.name!r} ({model.spec.footprint_bytes / 2**20:.0f} MiB) does not fit "
                    f"next to the models loaded ({self.used_bytes() / 2**20:.0f} of {self._budget_text()} MiB)")
            victim = min(candidates, key=lambda m: m.last_used)
            logger.info("unloading %s (least recently used) to load %s", victim.spec.name, model.spec.name)
            await self._unload(victim)
            self.num_swaps += 1

    async def _unload(self, model: PooledModel) -> None:
        async with self._changed:
            model.state = ModelState.DRAINING
            self._changed.notify_all()
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: model.leases <= 0),
                                       self.config.drain_timeout)
            except asyncio.TimeoutError:
                logger.warning("model %s: %d request(s) still running after %.0f s; stopping it anyway",
                               model.spec.name, model.leases, self.config.drain_timeout)
            model.state = ModelState.UNLOADING
            engine, model.engine = model.engine, None
        if engine is not None:
            await engine.shutdown()
        async with self._changed:
            model.state = ModelState.UNLOADED
            self._changed.notify_all()

    def _engine_died(self, model: PooledModel, engine: AsyncLLM, reason: str) -> None:
        """The model's engine process is gone: its requests failed already; load it afresh next time."""
        if model.engine is not engine or model.state is not ModelState.READY:
            return
        logger.error("model %s: the engine died (%s); it will be loaded again on the next request",
                     model.spec.name, reason)
        model.state = ModelState.UNLOADING
        model.engine = None

        async def clean_up() -> None:
            await engine.shutdown()
            async with self._changed:
                model.state = ModelState.UNLOADED
                self._changed.notify_all()

        task = asyncio.get_running_loop().create_task(clean_up())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for model in self.models.values():
            engine, model.engine = model.engine, None
            model.state = ModelState.UNLOADED
            if engine is not None:
                await engine.shutdown()

    def _notify(self) -> None:
        async def notify() -> None:
            async with self._changed:
                self._changed.notify_all()

        task = asyncio.get_running_loop().create_task(notify())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _budget_text(self) -> str:
        budget = self.config.memory_budget
        return "unbounded" if budget is None else f"{budget / 2**20:.0f}"
