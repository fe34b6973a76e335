"""The API server's reader of engine outputs (EngineCoreClient._drain) on a real ZeroMQ socket.

The outputs socket's FD signals edges only, so a backlog left unread would wait for the next frame;
and a long backlog must not hold the event loop for its whole length.
"""

from __future__ import annotations

import asyncio

import zmq

from kvik.core.config import EngineArgs
from kvik.engine import core_client
from kvik.engine.core_client import EngineCoreClient


def test_a_backlog_is_read_whole_in_order_in_turns_and_a_bad_frame_skipped(caplog) -> None:
    async def scenario() -> tuple[list[int], list[int]]:
        client = EngineCoreClient(EngineArgs(model="unused"), in_thread=True)
        sender = zmq.Context.shadow(client.context.underlying).socket(zmq.PUSH)
        sender.connect(client.output_address)
        loop = asyncio.get_running_loop()
        seen: list[int] = []
        turns: list[int] = []  # how many frames had been handled each time another task ran

        def on_frame(frame: bytes) -> None:
            if frame == b"bad":
                raise ValueError("undecodable frame")
            seen.append(int(frame))

        async def other_task() -> None:
            while len(seen) < total:
                turns.append(len(seen))
                await asyncio.sleep(0)

        total = 3 * core_client._FRAMES_PER_DRAIN + 5
        for index in range(total):
            sender.send(str(index).encode())
            if index == 10:
                sender.send(b"bad")
        await asyncio.sleep(0.2)  # all queued before the reader is watched: no edge will come for them
        client._loop, client._on_frame = loop, on_frame
        loop.add_reader(client.outputs.getsockopt(zmq.FD), client._drain)
        client._drain()
        watcher = asyncio.ensure_future(other_task())
        for _ in range(200):
            if len(seen) == total:
                break
            await asyncio.sleep(0.01)
        # A frame sent after the backlog is read still wakes the reader.
        sender.send(str(total).encode())
        for _ in range(200):
            if len(seen) == total + 1:
                break
            await asyncio.sleep(0.01)
        await watcher
        client._stop_reading()
        sender.close(0)
        client.inputs.close(0)
        client.outputs.close(0)
        client.context.term()
        return seen, turns

    seen, turns = asyncio.run(scenario())
    assert seen == list(range(3 * core_client._FRAMES_PER_DRAIN + 6))
    assert "reading engine outputs failed" in caplog.text
    # Other tasks ran while the backlog was being read, not only after it.
    assert any(0 < count < len(seen) - 1 for count in turns)
