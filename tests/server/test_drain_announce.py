"""`kvik serve --drain-announce-seconds`: after SIGTERM the server first says it is leaving while
it still serves (so a balancer takes it out of rotation before it refuses anything), then drains.
The gateway side of this handshake is tests/gateway/test_e2e_rollout.py."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

pytest.importorskip("torch")


def test_sigterm_announces_the_drain_while_still_serving_then_drains(server_factory) -> None:
    server = server_factory("--drain-announce-seconds", "3", "--drain-timeout", "30")
    body = {"model": "tiny", "prompt": "still here?", "max_tokens": 2}
    before = httpx.post(f"{server.base_url}/completions", json=body, timeout=30)
    assert before.status_code == 200 and "x-kvik-draining" not in before.headers

    server.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    time.sleep(0.3)
    health = httpx.get(f"{server.url}/health", timeout=5)
    assert (health.status_code, health.json()["status"], health.headers["x-kvik-draining"]) == (503, "draining", "1")
    during = httpx.post(f"{server.base_url}/completions", json=body, timeout=30)  # still served, marked
    assert during.status_code == 200 and during.headers["x-kvik-draining"] == "1"
    assert time.monotonic() - signalled < 3, "the announce period was over before the test could look"

    def refused() -> bool:
        try:
            answer = httpx.post(f"{server.base_url}/completions", json=body, timeout=30)
        except httpx.ConnectError:
            return True  # drained with nothing in flight and exited between two polls
        except httpx.RemoteProtocolError:
            # Connected in the instant the server closed its socket to exit: the kernel took the
            # connection, no handler ever saw the request. Only that exit explains it: a server
            # that hung up on a request and kept running fails here.
            return server.process.wait(timeout=10) == 0
        return answer.status_code == 503
    deadline = time.monotonic() + 20
    while not refused():
        assert time.monotonic() < deadline, "the server never started refusing"
        time.sleep(0.2)
    assert time.monotonic() - signalled >= 3  # not before the announce period ended
    assert server.process.wait(timeout=30) == 0


def test_sigint_skips_the_announce(server_factory) -> None:
    server = server_factory("--drain-announce-seconds", "60")
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(timeout=20) == 0
