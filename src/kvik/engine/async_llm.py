"""`AsyncLLM`: the asyncio front end of an engine core that runs in its own process (or a thread).

What the API server calls, and all it calls: render and tokenize (small inputs on the loop, large
ones and requests' own templates in killable workers), validate into an `EngineCoreRequest`
(`input_processor`), `generate()` to stream `RequestOutput`s, `abort()`, `stats()`, `alive`. Core
outputs are detokenized here, on the event loop, as they arrive (`output_processor`).

If the core dies, every request in flight raises `EngineDeadError` (503) at once, new ones are
refused the same way, and `on_dead` listeners (the server's launcher) are told, so health fails and
the process can exit for its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
import time
from typing import Any, AsyncIterator, Callable

from kvik.core import tracing
from kvik.core.chat_template import TemplateLimits
from kvik.core.config import EngineArgs
from kvik.core.errors import KvikError, ServiceUnavailableError
from kvik.core.outputs import PoolingRequestOutput, RequestOutput, merge_deltas
from kvik.core.sampling_params import OutputKind
from kvik.core.tokenizer import Tokenizer
from kvik.engine import request_spans
from kvik.engine.core_client import EngineCoreClient
from kvik.engine.input_processor import InputProcessor, utf8_size
from kvik.engine.messages import EngineCoreOutputs, EngineCoreRequest, EngineInfo, EngineStats, LoRAAdapterInfo
from kvik.engine.output_processor import OutputProcessor
from kvik.engine.preprocess_pool import (PreprocessConfig, PreprocessPool, RenderedPrompt,
                                         render_and_tokenize)

logger = logging.getLogger("kvik.engine")


class EngineDeadError(ServiceUnavailableError):
    """The engine core is not running; this replica cannot serve until it is restarted."""

    code = "engine_dead"


class GenerationError(KvikError):
    """The engine failed while generating this request (its step raised)."""

    http_status = 500
    error_type = "server_error"
    code = "generation_failed"


class AsyncLLM:
    def __init__(self, args: EngineArgs, *, engine_in_thread: bool = False,
                 preprocess: PreprocessConfig | None = None) -> None:
        self.args = args
        self.client = EngineCoreClient(args, in_thread=engine_in_thread)
        self.preprocess_config = preprocess or PreprocessConfig()
        self.info: EngineInfo | None = None
        self.tokenizer: Tokenizer | None = None
        self.input_processor: InputProcessor | None = None
        self.output_processor: OutputProcessor | None = None
        self.pool: PreprocessPool | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._stats = EngineStats()
        self._dead_listeners: list[Callable[[str], None]] = []
        self.dead_reason: str | None = None

    async def start(self) -> EngineInfo:
        """Start the core and wait for it to load the model; raises EngineStartError if it can't."""
        info = await self.client.start(self._on_outputs, self._on_dead)
        self.info = info
        limits = TemplateLimits(max_output_chars=max(2**20, 4 * info.max_model_len * 64))
        self.tokenizer = Tokenizer(info.tokenizer, limits)
        self.input_processor = InputProcessor(info, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._stats = EngineStats(num_blocks=info.num_kv_blocks, num_free_blocks=info.num_kv_blocks)
        if self.preprocess_config.workers > 0:
            self.pool = PreprocessPool(info.tokenizer, limits, self.preprocess_config, info.max_model_len)
        return info

    async def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.close()
        await self.client.shutdown()

    # -- health --

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and self.client.alive

    def on_dead(self, listener: Callable[[str], None]) -> None:
        self._dead_listeners.append(listener)

    def _on_dead(self, reason: str) -> None:
        self.dead_reason = reason
        error = EngineDeadError(f"the engine stopped ({reason}); retry on another replica", retry_after=5)
        for queue in self._queues.values():
            queue.put_nowait(error)
        self._queues.clear()
        for listener in self._dead_listeners:
            listener(reason)

    def _require_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine stopped ({self.dead_reason}); retry on another replica",
                                  retry_after=5)

    def stats(self) -> EngineStats:
        """The core's stats after its last step (or abort)."""
        return self._stats

    # -- preprocessing --

    @tracing.traced("tokenize")
    async def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                          template: str | None = None, tools: list[dict[str, Any]] | None = None,
                          template_kwargs: dict[str, Any] | None = None, input_bytes: int = 0,
                          reserve_tokens: int | None = None) -> RenderedPrompt:
        """Render a conversation and tokenize it. `input_bytes` (the request's size) decides where:
        small inputs with the model's own template on the loop, the rest in the worker pool, which
        refuses a prompt with no room for `reserve_tokens` of output before returning its ids."""
        kwargs = dict(template_kwargs or {})
        if self.pool is not None and (template is not None or input_bytes > self.preprocess_config.inline_bytes):
            return await self.pool.render(messages, add_generation_prompt=add_generation_prompt,
                                          template=template, tools=tools, template_kwargs=kwargs,
                                          reserve_tokens=reserve_tokens)
        return render_and_tokenize(self.tokenizer, messages, add_generation_prompt=add_generation_prompt,
                                   template=template, tools=tools, template_kwargs=kwargs)

    @tracing.traced("tokenize")
    async def tokenize(self, texts: list[str], add_special_tokens: bool = True,
                       reserve_tokens: int | None = None) -> list[list[int]]:
        for text in texts:
            self.input_processor.check_text_size(utf8_size(text), "prompt")
        if self.pool is not None and sum(len(t) for t in texts) > self.preprocess_config.inline_bytes:
            return await self.pool.tokenize(texts, add_special_tokens, reserve_tokens)
        return [self.tokenizer.encode(text, add_special_tokens=add_special_tokens) for text in texts]

    # -- generation --

    async def generate(self, request: EngineCoreRequest, prompt: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (in `request.params.output_kind`). Closing the iterator
        early aborts the request in the core."""
        request_id = request.request_id
        queue = self._open_queue(request_id)
        state = self.output_processor.add_request(request_id, prompt, request.prompt_token_ids, request.params,
                                                  request.arrival_time)
        span = request_spans.start_generate_span(request_id, len(request.prompt_token_ids),
                                                 request.max_tokens) if tracing.enabled() else None
        state.traced = span is not None
        sent_time = time.time()
        finished = False
        error: str | None = None
        coalesce = request.params.output_kind is OutputKind.DELTA
        queued_error: BaseException | None = None
        try:
            await self.client.add_request(request)
            while True:
                item = queued_error or await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    error = str(item)
                    raise item
                while coalesce and not item.finished and not queue.empty():
                    # The consumer fell behind: one output for the whole backlog (vLLM does the same).
                    later = queue.get_nowait()
                    if isinstance(later, BaseException):
                        queued_error = later  # raised after what came before it
                        break
                    item = merge_deltas(item, later)
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if span is not None:
                request_spans.end_generate_span(span, state, sent_time, error)
            if not finished:
                await self.abort(request_id)

    def _open_queue(self, request_id: str) -> asyncio.Queue[Any]:
        """The queue the output loop fills for `request_id` (refused on a dead engine or a reused id)."""
        self._require_alive()
        if request_id in self._queues:
            raise KvikError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    async def encode(self, request: EngineCoreRequest) -> PoolingRequestOutput:
        """Run a pooling request (`request.pooling` set) and return its vector. Cancelling the
        call aborts the request in the core."""
        request_id = request.request_id
        queue = self._open_queue(request_id)
        self.output_processor.add_pooling_request(request_id, request.prompt_token_ids, request.arrival_time)
        finished = False
        try:
            await self.client.add_request(request)
            item = await queue.get()
            finished = True
            if isinstance(item, BaseException):
                raise item
            return item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self.output_processor.abort_request(request_id)
        try:
            await self.client.abort([(request_id, -1)])
        except Exception:  # noqa: BLE001 - a dead engine has nothing left to abort
            pass

    def _on_outputs(self, message: EngineCoreOutputs) -> None:
        if message.stats is not None:
            self._stats = message.stats
        if not message.outputs:
            return
        processed = self.output_processor.process(message.outputs)
        for output in processed.outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)
        for request_id, text in processed.failures:
            queue = self._queues.pop(request_id, None)
            if queue is not None:
                queue.put_nowait(GenerationError(text))
        if processed.aborts:
            asyncio.ensure_future(self.client.abort(processed.aborts))

    async def reset_prefix_cache(self) -> int:
        return await self.client.call("reset_prefix_cache")

    async def add_lora(self, name: str, path: str) -> LoRAAdapterInfo:
        """Have the core read, check and serve a PEFT adapter directory as `name` (typed errors:
        LoRAAdapterError, ConflictError, InvalidRequestError)."""
        self._require_alive()
        return msgspec.convert(await self.client.call("add_lora", name, path), LoRAAdapterInfo)

    async def remove_lora(self, name: str) -> None:
        """Stop serving an adapter (NotFoundError if unknown, ConflictError while requests use it)."""
        self._require_alive()
        await self.client.call("remove_lora", name)
