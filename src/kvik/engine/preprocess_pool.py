"""Chat-template rendering and tokenization in worker processes the front end can kill.

The Rust tokenizer holds the GIL while it encodes (seconds for megabytes of text) and a chat template
is Jinja code that can loop for as long as it likes, so neither may run on the server's event loop
for anything but small inputs: there they would stall every other stream and `/health` with them.
Large inputs, and every template a request brings itself, go to a pool of worker processes (pebble,
spawn): each job has a deadline after which its worker is killed and replaced and the request gets a
400; each worker has a memory ceiling; workers are replaced after a number of jobs, so whatever a
multi-megabyte prompt left in a worker's heap is returned to the system.

Workers load only the `tokenizers` backend from the engine's `TokenizerSpec` (no transformers, no
torch), so the pool starts in well under a second.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import resource
from dataclasses import dataclass
from typing import Any

from kvik.core import client_json
from kvik.core.chat_template import ChatTemplateError, TemplateLimits
from kvik.core.errors import ContextLengthExceededError, InvalidRequestError
from kvik.core.memory import release_freed_memory
from kvik.core.tokenizer import Tokenizer, TokenizerSpec
from kvik.engine.input_processor import check_output_room

logger = logging.getLogger("kvik.engine")


@dataclass(slots=True)
class PreprocessConfig:
    workers: int = 2
    timeout: float = 20.0  # seconds one render or tokenization may take in a worker
    memory_limit: int = 4 * 2**30  # address space of a worker, bytes
    jobs_per_worker: int = 200  # then the worker is replaced (returns its heap to the system)
    inline_bytes: int = 16 * 1024  # smaller inputs with the model's own template run in-process


@dataclass(slots=True)
class RenderedPrompt:
    text: str
    token_ids: list[int]


@dataclass(slots=True)
class ParsedBody:
    """A JSON request body parsed in a worker: the value, or why it is not JSON."""

    value: Any = None
    error: tuple[str, int] | None = None  # json.JSONDecodeError's message and position
    failure: str | None = None  # any other reason (nested too deep, not UTF-8)


# -- in the worker process --

_worker_tokenizer: Tokenizer | None = None
_worker_max_tokens = 0


def _init_worker(spec: TokenizerSpec, limits: TemplateLimits, memory_limit: int, max_tokens: int) -> None:
    global _worker_tokenizer, _worker_max_tokens
    if memory_limit > 0:
        try:
            resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
        except (ValueError, OSError):
            pass
    _worker_tokenizer = Tokenizer(spec, limits)
    _worker_max_tokens = max_tokens


def _check_length(ids: list[int], where: str, reserve_tokens: int | None = None) -> list[int]:
    """A prompt that cannot fit the context (with the `reserve_tokens` of output the request asked
    for) is refused here, so its (possibly millions of) ids are never shipped to the server:
    unpickling a million ids holds the server's GIL for ~60 ms."""
    if _worker_max_tokens and reserve_tokens:
        check_output_room(_worker_max_tokens, len(ids), reserve_tokens, where)
    if _worker_max_tokens and len(ids) >= _worker_max_tokens:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {_worker_max_tokens} tokens, but the {where} has "
            f"{len(ids)} tokens, leaving no room for output. Shorten the {where}.", param=where)
    return ids


def render_and_tokenize(tokenizer: Tokenizer, messages: list[dict[str, Any]], *,
                        add_generation_prompt: bool, template: str | None,
                        tools: list[dict[str, Any]] | None, template_kwargs: dict[str, Any]) -> RenderedPrompt:
    """The chat prompt and its tokens. The template writes whatever special tokens the model
    expects, so the tokenizer adds none."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         chat_template=template, tools=tools, **template_kwargs)
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except InvalidRequestError as exc:
        raise InvalidRequestError(exc.message.replace("prompt:", "messages:"), param="messages") from exc
    return RenderedPrompt(text, ids)


def _render_job(messages: list[dict[str, Any]], add_generation_prompt: bool, template: str | None,
                tools: list[dict[str, Any]] | None, template_kwargs: dict[str, Any],
                reserve_tokens: int | None) -> RenderedPrompt:
    try:
        rendered = render_and_tokenize(_worker_tokenizer, messages, add_generation_prompt=add_generation_prompt,
                                       template=template, tools=tools, template_kwargs=template_kwargs)
        _check_length(rendered.token_ids, "messages", reserve_tokens)
        return rendered
    finally:  # encoding megabytes allocates hundreds of MB of short-lived buffers
        release_freed_memory()


def _parse_json_job(body: bytes) -> ParsedBody:
    try:
        return ParsedBody(client_json.loads(body))
    except json.JSONDecodeError as exc:  # not pickled as is: it would carry the whole body back
        return ParsedBody(error=(exc.msg, exc.pos))
    except (ValueError, RecursionError) as exc:
        return ParsedBody(failure=f"{type(exc).__name__}: {str(exc)[:200]}")
    finally:
        release_freed_memory()


def _tokenize_job(texts: list[str], add_special_tokens: bool, reserve_tokens: int | None) -> list[list[int]]:
    try:
        return [_check_length(_worker_tokenizer.encode(text, add_special_tokens=add_special_tokens), "prompt",
                              reserve_tokens)
                for text in texts]
    finally:
        release_freed_memory()


# -- in the front end --

class PreprocessPool:
    def __init__(self, spec: TokenizerSpec, limits: TemplateLimits, config: PreprocessConfig,
                 max_prompt_tokens: int = 0) -> None:
        import multiprocessing

        import pebble

        self.config = config
        self._pool = pebble.ProcessPool(max_workers=config.workers, max_tasks=config.jobs_per_worker,
                                        initializer=_init_worker,
                                        initargs=(spec, limits, config.memory_limit, max_prompt_tokens),
                                        context=multiprocessing.get_context("spawn"))

    async def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                     template: str | None, tools: list[dict[str, Any]] | None,
                     template_kwargs: dict[str, Any], reserve_tokens: int | None = None) -> RenderedPrompt:
        future = self._pool.schedule(_render_job, (messages, add_generation_prompt, template, tools,
                                                   template_kwargs, reserve_tokens), timeout=self.config.timeout)
        return await self._result(future, "rendering the chat template", "messages")

    async def tokenize(self, texts: list[str], add_special_tokens: bool,
                       reserve_tokens: int | None = None) -> list[list[int]]:
        future = self._pool.schedule(_tokenize_job, (texts, add_special_tokens, reserve_tokens),
                                     timeout=self.config.timeout)
        return await self._result(future, "tokenizing the prompt", "prompt")

    async def parse_json(self, body: bytes) -> ParsedBody:
        future = self._pool.schedule(_parse_json_job, (body,), timeout=self.config.timeout)
        return await self._result(future, "parsing the JSON body", "body")

    async def _result(self, future: Any, what: str, param: str) -> Any:
        from pebble import ProcessExpired

        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()  # the client left: pebble stops the worker's job
            raise
        except concurrent.futures.TimeoutError:
            raise InvalidRequestError(f"{param}: {what} took longer than {self.config.timeout:.0f} s "
                                      "and was stopped; send a smaller request", param=param) from None
        except ProcessExpired as exc:
            raise InvalidRequestError(f"{param}: {what} exceeded the worker's limits ({exc}); send a "
                                      "smaller request", param=param) from None
        except MemoryError:
            raise ChatTemplateError(f"{param}: {what} ran out of memory; send a smaller request",
                                    param=param) from None

    def close(self) -> None:
        self._pool.stop()
        self._pool.join(timeout=5)
