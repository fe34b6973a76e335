"""Noticing that a client left while the gateway waits for the replica.

An ASGI server does not cancel a handler whose client disconnected: it only reports the disconnect
to the next `receive()`. A handler that awaits a non-streaming answer would therefore keep the
replica generating for nobody. `unless_disconnected` races the work against that `receive()` and
cancels the work when the client is gone, which closes its upstream connection, and the replica
(kvik serve, vLLM) aborts the request when its client leaves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise `ClientDisconnected`.
    The request body must have been read in full (the next message is then the disconnect)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task  # let its cleanup (closing the upstream connection, releasing the slot) run
    except asyncio.CancelledError:
        pass
    except Exception:  # noqa: BLE001 - the client is gone; nobody is left to tell
        pass
    raise ClientDisconnected


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
