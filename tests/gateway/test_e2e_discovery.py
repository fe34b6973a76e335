"""DNS service discovery with real processes (issue 16, must-show 5): two `kvik serve` replicas of
the tiny Llama, a real DNS server on 127.0.0.1 (tests/gateway/dns_server.py) whose SRV records
the test changes, and one `kvik gateway` that re-resolves the name every second through
dnspython. Replicas appear and disappear behind the name while streams run; the gateway picks each
change up within the re-resolve interval (plus one health probe for a new replica), and no request
fails. SRV rather than A records because both replicas listen on 127.0.0.1 and differ only by port;
the A/AAAA path is checked against the same server in test_live_replicas.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway.dns_server import TestDnsServer
from tests.gateway.harness import UPSTREAM_MODEL, GatewayFactory, KvikServe, free_port, wait_for
from tests.gateway.stream_load import StreamLoad

pytest.importorskip("torch")  # the replicas are kvik serve

pytestmark = pytest.mark.timeout(300)
NAME = "_http._tcp.replicas.kvik.test"
INTERVAL_S = 1.0  # re-resolve interval
PROBE_S = 0.5  # the test gateways' health probe interval
SLACK_S = 2.0  # for a busy machine: two cores shared by two replicas, the gateway and the test


@pytest.fixture(scope="module")
def dns_server() -> Iterator[TestDnsServer]:
    server = TestDnsServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pair(tiny_llama: Path, workdir: Path) -> Iterator[list[KvikServe]]:
    replicas = [KvikServe(name, tiny_llama, free_port(), workdir) for name in ("dns-1", "dns-2")]
    try:
        for replica in replicas:
            replica.launch()
        for replica in replicas:
            replica.wait_ready(120)
        yield replicas
    finally:
        for replica in replicas:
            replica.stop()


def seconds_until(condition, timeout: float) -> float:
    started = time.monotonic()
    wait_for(condition, timeout=timeout, interval=0.02)
    return time.monotonic() - started


def test_replicas_appear_and_disappear_behind_a_dns_name_without_a_failed_request(
        dns_server: TestDnsServer, pair: list[KvikServe], gateways: GatewayFactory) -> None:
    first, second = pair
    dns_server.set_srv(NAME, [first.port])
    gateway = gateways.start({"models": [{
        "name": "tiny", "upstream_model": UPSTREAM_MODEL,
        "discovery": {"dns": {"name": NAME, "srv": True, "interval_s": INTERVAL_S,
                              "nameservers": [dns_server.nameserver]}}}]}, name="dns")
    wait_for(lambda: gateway.replicas().get(first.url, {}).get("state") == "up", timeout=10)
    key = gateway.create_key(name="dns")
    load = StreamLoad(gateway.url, key, total=10_000, concurrency=4, max_tokens=8).start()
    try:
        load.wait_started(8)
        served_before = second.requests_served()
        dns_server.set_srv(NAME, [first.port, second.port])  # a replica appears
        appeared_s = seconds_until(lambda: gateway.replicas().get(second.url, {}).get("state") == "up",
                                   timeout=INTERVAL_S + PROBE_S + SLACK_S)
        wait_for(lambda: second.requests_served() > served_before, timeout=10)

        dns_server.set_srv(NAME, [second.port])  # one disappears: drained, then dropped
        gone_s = seconds_until(lambda: first.url not in gateway.replicas(), timeout=INTERVAL_S + SLACK_S)
        served_after_drop = first.requests_served()
        load.wait_started(load.started + 20)  # more traffic: none of it may reach the dropped replica
        assert first.requests_served() == served_after_drop

        dns_server.set_srv(NAME, [first.port, second.port])  # and comes back
        wait_for(lambda: gateway.replicas().get(first.url, {}).get("state") == "up",
                 timeout=INTERVAL_S + PROBE_S + SLACK_S)
        load.wait_started(load.started + 20)
    finally:
        load.stop()
        outcomes = load.join()
    assert outcomes and load.failures() == []
    print(f"DNS discovery: a new replica up {appeared_s:.2f} s and a removed one dropped {gone_s:.2f} s after "
          f"the records changed (re-resolve interval {INTERVAL_S} s); {len(outcomes)} streams, none failed")
