"""Issue 10, finding 12 (gateway): slow clients (slowloris) are cut off by header and body read
timeouts, and `/metrics`, which names every replica URL, is on its own listener or needs an admin key."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.gateway.harness import ADMIN_KEY, Gateway, GatewayFactory, Upstream, free_port, model_config

pytestmark = pytest.mark.timeout(180)

TIMEOUT_S = 2.0  # the test gateway's header and body timeouts
TRICKLE_FOR_S = 20.0  # how long a slow client keeps sending before it gives up


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def gateway(gateways: GatewayFactory, upstreams: list[Upstream], metrics_port: int) -> Gateway:
    return gateways.start({"models": [model_config("tiny", upstreams)],
                           "limits": {"header_timeout_s": TIMEOUT_S, "body_timeout_s": TIMEOUT_S},
                           "metrics": {"port": metrics_port}}, name="client-limits")


def trickle(port: int, data: bytes, *, head: bytes = b"", interval_s: float = 1.0) -> tuple[float, bytes]:
    """Send `head` at once, then `data` one byte per `interval_s`, until the server closes the
    connection or TRICKLE_FOR_S passes. Returns (seconds the connection stayed open, the answer)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=TRICKLE_FOR_S + 5) as sock:
        sock.sendall(head)
        sock.setblocking(False)
        answer = b""
        for byte in data:
            if time.monotonic() - started > TRICKLE_FOR_S:
                break
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            deadline = time.monotonic() + interval_s
            closed = False
            while time.monotonic() < deadline:
                try:
                    part = sock.recv(4096)
                except BlockingIOError:
                    time.sleep(0.05)
                    continue
                except ConnectionResetError:
                    closed = True
                    break
                if not part:
                    closed = True
                    break
                answer += part
            if closed:
                break
        return time.monotonic() - started, answer


def test_headers_sent_one_byte_per_second_are_cut_off(gateway: Gateway) -> None:
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
               b"x-padding: " + b"a" * 200 + b"\r\n\r\n")
    open_for, answer = trickle(gateway.port, request)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert open_for < TRICKLE_FOR_S / 2  # closed after the header timeout, not when the client gave up


def test_a_body_sent_one_byte_per_second_is_cut_off(gateway: Gateway) -> None:
    key = gateway.create_key(name="slow-body")
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\ncontent-length: 500\r\n\r\n").encode()
    open_for, answer = trickle(gateway.port, b"{" + b" " * 499, head=head)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"request_timeout" in answer and b"connection: close" in answer.lower()
    assert open_for < TRICKLE_FOR_S / 2


def test_a_silent_connection_is_closed(gateway: Gateway) -> None:
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=TRICKLE_FOR_S) as sock:
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - started < TRICKLE_FOR_S / 2


def test_ordinary_clients_keep_their_connection(gateway: Gateway) -> None:
    key = gateway.create_key(name="keep-alive")
    with gateway.client(key) as client:
        for _ in range(3):
            response = client.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert response.status_code == 200 and "close" not in response.headers.get("connection", "")
            time.sleep(TIMEOUT_S * 0.75)  # idle between requests is the keep-alive timeout's business


def test_metrics_live_on_their_own_listener(gateway: Gateway, upstreams: list[Upstream], metrics_port: int) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert httpx.get(gateway.url + "/metrics", headers=admin, timeout=5).status_code == 404
    scraped = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)
    assert scraped.status_code == 200 and upstreams[0].url in scraped.text
    assert httpx.get(f"http://127.0.0.1:{metrics_port}/v1/models", headers=admin, timeout=5).status_code == 404
    assert httpx.get(f"http://127.0.0.1:{metrics_port}/admin/keys", headers=admin, timeout=5).status_code == 404


def test_metrics_on_the_main_port_need_an_admin_key(gateways: GatewayFactory, upstreams: list[Upstream]) -> None:
    gateway = gateways.start({"models": [model_config("tiny", upstreams)]}, name="metrics-auth")
    user = gateway.create_key(name="not-admin")
    assert httpx.get(gateway.url + "/metrics", timeout=5).status_code == 401
    as_user = httpx.get(gateway.url + "/metrics", headers={"Authorization": f"Bearer {user}"}, timeout=5)
    assert as_user.status_code == 403
    scraped = httpx.get(gateway.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=5)
    assert scraped.status_code == 200 and "kvik_gateway_replica_healthy" in scraped.text
