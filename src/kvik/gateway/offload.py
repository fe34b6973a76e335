"""CPU-heavy request work (JSON parsing, PII redaction, cache keys, encoding) off the event loop.

A multi-megabyte body takes the gateway seconds of CPU; on the event loop that is seconds in which
no other tenant's request moves. Bodies up to `INLINE_BYTES` are handled inline (a thread hop costs
more than the work); larger ones go to a small dedicated pool, so a burst of huge bodies queues
behind each other instead of taking every thread of the default executor. Redaction releases the
GIL between windows of text, so the loop keeps its turn while a worker scans.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

INLINE_BYTES = 64 * 1024


class CpuWorkers:
    def __init__(self, threads: int = 2) -> None:
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="kvik-gateway-cpu")

    async def run(self, size: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` inline when the request is small (`size` bytes), else in a worker."""
        if size <= INLINE_BYTES:
            return fn(*args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
