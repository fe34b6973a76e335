"""The online load generator: send a workload to an OpenAI-compatible endpoint and time every stream.

Requests arrive as a Poisson process at `request_rate` (seeded exponential gaps; `inf` sends them all
at once), optionally capped at `max_concurrency` requests in flight. Every request streams (SSE) with
`stream_options.include_usage`, `ignore_eos` and greedy sampling, over one httpx AsyncClient without
retries: a benchmark must see failures, not hide them.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from kvik.bench.stats import RequestRecord
from kvik.bench.workloads import BenchRequest
from kvik.core.errors import ConfigError

SSE_LINE_END = re.compile(r"\r\n|\r|\n")


@dataclass(slots=True)
class LoadConfig:
    """Where and how to send the workload."""

    base_url: str
    model: str
    endpoint: str = "completions"  # or "chat"
    api_key: str | None = None
    request_rate: float = math.inf  # requests per second
    max_concurrency: int | None = None
    seed: int = 0
    timeout_s: float = 3600.0
    show_progress: bool = True


@dataclass(slots=True)
class LoadResult:
    records: list[RequestRecord]
    duration_s: float  # first request sent -> last request finished


def api_root(base_url: str) -> str:
    """The server root: 'http://h:8000/v1/' and 'http://h:8000' both give 'http://h:8000'."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def endpoint_url(base_url: str, endpoint: str) -> str:
    path = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}[endpoint]
    return api_root(base_url) + path


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def request_body(request: BenchRequest, config: LoadConfig) -> dict[str, Any]:
    """The JSON body: greedy, streamed with a usage chunk, ignore_eos so output lengths are exact."""
    body: dict[str, Any] = {"model": config.model, "stream": True, "temperature": 0.0,
                            "stream_options": {"include_usage": True}, "ignore_eos": True}
    if config.endpoint == "chat":
        body["messages"] = request.messages
    else:
        body["prompt"] = request.prompt
    if request.max_tokens is not None:
        body["max_tokens"] = request.max_tokens
    return body


def arrival_times(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times in seconds after the start: 0 for the first, then cumulative Exp(rate) gaps."""
    if request_rate <= 0:
        raise ConfigError("--request-rate must be positive (or inf)")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    times, now = [], 0.0
    for index in range(num_requests):
        if index:
            now += rng.expovariate(request_rate)
        times.append(now)
    return times


def is_token_chunk(payload: dict[str, Any], chat: bool) -> bool:
    """Whether an SSE chunk carries generated tokens (not the role header, not a bare finish/usage chunk).

    A chunk with empty text that is not the finishing one still counts: servers stream a token whose
    bytes do not yet form a whole UTF-8 character as an empty piece.
    """
    choices = payload.get("choices") or []
    if not choices:
        return False
    choice = choices[0]
    if chat:
        delta = choice.get("delta") or {}
        if delta.get("content"):
            return True
        return "role" not in delta and choice.get("finish_reason") is None
    return bool(choice.get("text")) or choice.get("finish_reason") is None


def split_sse_lines(buffer: str) -> tuple[list[str], str]:
    """The complete lines at the start of `buffer` and what is left for the next chunk. SSE ends a
    line only at CR, LF or CRLF; a CR that ends the buffer may be the first half of a CRLF, so it
    waits for the next chunk."""
    cut = len(buffer) - 1 if buffer.endswith("\r") else len(buffer)
    *lines, rest = SSE_LINE_END.split(buffer[:cut])
    return lines, rest + buffer[cut:]


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The lines of an event stream. httpx's aiter_lines() also splits at U+2028, U+0085 and other
    characters that JSON carries raw inside strings (a random-weight model generates them), which
    cut an event in two."""
    buffer = ""
    async for text in response.aiter_text():
        lines, buffer = split_sse_lines(buffer + text)
        for line in lines:
            yield line
    if buffer:
        yield buffer.removesuffix("\r")


async def send_request(client: httpx.AsyncClient, url: str, headers: dict[str, str], body: dict[str, Any],
                       record: RequestRecord, chat: bool, bench_start: float) -> RequestRecord:
    """Stream one request, filling `record` with its timings; errors are recorded, never raised."""
    sent = time.perf_counter()
    record.start_s = sent - bench_start
    last = sent
    chunks, usage_tokens, done = 0, None, False
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:300]}"
                return record
            async for line in sse_lines(response):
                if not line.startswith("data:"):
                    continue  # blank separators and ': keep-alive' comments
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                payload = json.loads(data)
                if "error" in payload:
                    record.error = f"error in stream: {json.dumps(payload['error'])[:300]}"
                    return record
                usage = payload.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens")
                    record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
                # A first chunk that already finishes carried the only token (kvik and vLLM send the
                # last token with the finish reason; it may decode to no text on its own).
                first_and_last = record.ttft_s is None and any(
                    c.get("finish_reason") for c in payload.get("choices") or [])
                if is_token_chunk(payload, chat) or first_and_last:
                    if record.ttft_s is None:
                        record.ttft_s = now - sent
                    else:
                        record.itl_s.append(now - last)
                    last = now
                    chunks += 1
        record.e2e_s = time.perf_counter() - sent
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    # Without a usage chunk, count chunks: one token each on kvik and vLLM unless they batch tokens.
    record.output_tokens = usage_tokens if usage_tokens is not None else chunks
    if not done:
        record.error = "stream ended without [DONE]"
    elif record.ttft_s is None:
        record.error = "stream finished without generating a token"
    else:
        record.success = True
    return record


async def probe(client: httpx.AsyncClient, config: LoadConfig) -> None:
    """One tiny untimed request first, so a wrong URL, model or key fails at once and not 64 times.

    The prompt shares nothing with the workloads, so it cannot warm a prefix cache for them.
    """
    chat = config.endpoint == "chat"
    request = BenchRequest(messages=[{"role": "user", "content": "Hello"}] if chat else None,
                           prompt=None if chat else "Hello", max_tokens=1)
    record = await send_request(client, endpoint_url(config.base_url, config.endpoint),
                                auth_headers(config.api_key), request_body(request, config),
                                RequestRecord(index=-1), chat, time.perf_counter())
    if not record.success:
        raise ConfigError(f"the server at {config.base_url} did not answer a probe request: {record.error}")


async def fetch_vocab_size(base_url: str, api_key: str | None) -> int | None:
    """The vocabulary size from GET /tokenizer_info (kvik, vLLM, the naive server); None if absent."""
    async with httpx.AsyncClient(timeout=30) as client:
        try:
            response = await client.get(api_root(base_url) + "/tokenizer_info", headers=auth_headers(api_key))
        except httpx.HTTPError as exc:
            reason = f"{type(exc).__name__}: {exc}"
            raise ConfigError(f"could not reach the server at {base_url} ({reason})") from None
        try:
            size = response.json().get("vocab_size") if response.status_code == 200 else None
        except (ValueError, AttributeError):
            return None
    return size if isinstance(size, int) and size > 0 else None


async def run_load(requests: list[BenchRequest], config: LoadConfig) -> LoadResult:
    """Send `requests` on their arrival schedule and wait for all of them; the run's records in order."""
    if config.max_concurrency is not None and config.max_concurrency < 1:
        raise ConfigError("--max-concurrency must be at least 1")
    chat = config.endpoint == "chat"
    url, headers = endpoint_url(config.base_url, config.endpoint), auth_headers(config.api_key)
    times = arrival_times(len(requests), config.request_rate, config.seed)
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    # No connection cap: httpx's default pool of 100 would queue requests in the client and hide load.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(config.timeout_s), limits=limits) as client:
        await probe(client, config)
        progress = _progress_bar(len(requests), config.show_progress)

        async def one(index: int, request: BenchRequest) -> RequestRecord:
            record = RequestRecord(index=index, expected_output_tokens=request.max_tokens,
                                   prompt_tokens=request.prompt_tokens)
            body = request_body(request, config)
            if limit is None:
                await send_request(client, url, headers, body, record, chat, start)
            else:
                async with limit:  # TTFT is timed from the send, not from the wait for a slot
                    await send_request(client, url, headers, body, record, chat, start)
            if progress is not None:
                progress.update(1)
            return record

        start = time.perf_counter()
        tasks = []
        for index, (request, at) in enumerate(zip(requests, times)):
            # Sleep to absolute times so the time spent creating tasks does not stretch the schedule.
            delay = at - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(index, request)))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    if progress is not None:
        progress.close()
    return LoadResult(records=list(records), duration_s=duration)


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", dynamic_ncols=True)
