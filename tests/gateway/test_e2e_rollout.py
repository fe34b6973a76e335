"""Zero-loss changes of the replica set with real processes: `kvik serve` replicas of the tiny
Llama behind one `kvik gateway`, and streamed requests running the whole time.

- A rolling update through config reload (issue 16, must-show 2): two replicas replaced one by one
  by two new processes while 200 streams run, 16 at a time; every stream ends with a
  finish_reason and [DONE]; an old process is terminated (by pid) only after the gateway dropped
  it, which it does once the streams it carried have finished.
- SIGTERM of a replica behind the gateway under load: the replica announces its drain first (its
  /health and its responses say so while it still serves), the gateway stops routing to it, and
  no request sees a 503, not even the gateway (no 503 from the replica, no breaker trip).
- DNS discovery (issue 16, must-show 5): a real DNS server on 127.0.0.1 (dns_server.py) whose SRV
  records the test changes, and a gateway that re-resolves the name every second through
  dnspython. Replicas appear and disappear behind the name while streams run; the gateway picks
  each change up within the re-resolve interval (plus one health probe for a new replica), and no
  request fails. SRV rather than A records because both replicas listen on 127.0.0.1 and differ
  only by port; the A/AAAA path is checked against the same server in test_live_replicas.py.

The discovery test and the SIGTERM test share one pair of replicas; the SIGTERM test runs last.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway.dns_server import TestDnsServer
from tests.gateway.harness import UPSTREAM_MODEL, Gateway, GatewayFactory, KvikServe, free_port, model_config, wait_for
from tests.gateway.stream_load import StreamLoad

pytest.importorskip("torch")  # the replicas are kvik serve

pytestmark = pytest.mark.timeout(420)
READY_TIMEOUT_S = 120.0
SRV_NAME = "_http._tcp.replicas.kvik.test"
INTERVAL_S = 1.0  # re-resolve interval
PROBE_S = 0.5  # the test gateways' health probe interval
SLACK_S = 2.0  # for a busy machine: two cores shared by two replicas, the gateway and the test


@pytest.fixture(scope="module")
def pair(tiny_llama: Path, workdir: Path) -> Iterator[list[KvikServe]]:
    """Two replicas that keep serving for 3 s after SIGTERM (the gateways here probe every second
    at most); the last test of the module stops one with SIGTERM."""
    replicas = [KvikServe(name, tiny_llama, free_port(), workdir, extra=("--drain-announce-seconds", "3"))
                for name in ("pair-a", "pair-b")]
    try:
        for replica in replicas:
            replica.launch()
        for replica in replicas:
            replica.wait_ready(READY_TIMEOUT_S)
        yield replicas
    finally:
        for replica in replicas:
            replica.stop()


@pytest.fixture(scope="module")
def dns_server() -> Iterator[TestDnsServer]:
    server = TestDnsServer().start()
    yield server
    server.stop()


def seconds_until(condition, timeout: float) -> float:
    started = time.monotonic()
    wait_for(condition, timeout=timeout, interval=0.02)
    return time.monotonic() - started


def start_replicas(names: list[str], model_dir: Path, workdir: Path, *extra: str) -> list[KvikServe]:
    replicas = [KvikServe(name, model_dir, free_port(), workdir, extra=extra) for name in names]
    for replica in replicas:
        replica.launch()
    for replica in replicas:
        replica.wait_ready(READY_TIMEOUT_S)
    return replicas


@pytest.fixture
def processes() -> Iterator[list[KvikServe]]:
    """Every replica a test starts, stopped at the end whatever happened."""
    started: list[KvikServe] = []
    yield started
    for replica in started:
        replica.stop()


def replace(gateway: Gateway, leaving: KvikServe, arriving: KvikServe, staying: KvikServe) -> int:
    """Swap `leaving` for `arriving` through the config file and the admin API; wait until the
    gateway dropped `leaving` (its streams finished) and `arriving` is up; then terminate `leaving`
    by pid. Returns how many requests `leaving` still had in flight when the reload came."""
    gateway.rewrite_config(models=[model_config("tiny", [staying, arriving])])
    response = gateway.reload()
    assert response.status_code == 200, response.text
    result = response.json()
    assert [r["url"] for r in result["replicas_added"]] == [arriving.url]
    assert [r["url"] for r in result["replicas_draining"]] == [leaving.url]
    wait_for(lambda: leaving.url not in gateway.replicas(), timeout=120, interval=0.05)
    wait_for(lambda: gateway.replicas().get(arriving.url, {}).get("state") == "up", timeout=30)
    assert leaving.stop() == 0  # SIGTERM by pid; nothing is in flight on it any more
    return result["replicas_draining"][0]["outstanding"]


@pytest.mark.slow
def test_rolling_update_under_streaming_load_loses_nothing(tiny_llama: Path, workdir: Path, gateways: GatewayFactory,
                                                            processes: list[KvikServe]) -> None:
    processes += start_replicas(["old-a", "old-b", "new-c", "new-d"], tiny_llama, workdir)
    old_a, old_b, new_c, new_d = processes
    gateway = gateways.start({"models": [model_config("tiny", [old_a, old_b])], "reload": {"watch": False}},
                             name="rollout")
    key = gateway.create_key(name="rollout")
    load = StreamLoad(gateway.url, key, total=200, concurrency=16, max_tokens=24)
    load.allow(100)  # the second half waits for the first swap, so both swaps happen under load
    load.start()

    load.wait_started(40)
    in_flight_first = replace(gateway, old_a, new_c, staying=old_b)
    load.allow(200)
    load.wait_started(min(load.started + 20, 160))
    in_flight_second = replace(gateway, old_b, new_d, staying=new_c)
    outcomes = load.join()

    assert len(outcomes) == 200
    assert load.failures() == []  # no failed request, no truncated stream
    assert all(o.finish_reason == "length" and o.done for o in outcomes)
    # The swaps happened under load: the leaving replicas had streams in flight, which finished.
    assert in_flight_first + in_flight_second > 0, (in_flight_first, in_flight_second)
    assert new_c.requests_served() > 0 and new_d.requests_served() > 0
    assert set(gateway.replicas()) == {new_c.url, new_d.url}
    print(f"rolling update: 200/200 streams complete; in flight on the leaving replica at each reload: "
          f"{in_flight_first}, {in_flight_second}")


def test_replicas_appear_and_disappear_behind_a_dns_name_without_a_failed_request(
        dns_server: TestDnsServer, pair: list[KvikServe], gateways: GatewayFactory) -> None:
    first, second = pair
    dns_server.set_srv(SRV_NAME, [first.port])
    gateway = gateways.start({"models": [{
        "name": "tiny", "upstream_model": UPSTREAM_MODEL,
        "discovery": {"dns": {"name": SRV_NAME, "srv": True, "interval_s": INTERVAL_S,
                              "nameservers": [dns_server.nameserver]}}}]}, name="dns")
    wait_for(lambda: gateway.replicas().get(first.url, {}).get("state") == "up", timeout=10)
    key = gateway.create_key(name="dns")
    load = StreamLoad(gateway.url, key, total=10_000, concurrency=4, max_tokens=8).start()
    try:
        load.wait_started(8)
        served_before = second.requests_served()
        dns_server.set_srv(SRV_NAME, [first.port, second.port])  # a replica appears
        appeared_s = seconds_until(lambda: gateway.replicas().get(second.url, {}).get("state") == "up",
                                   timeout=INTERVAL_S + PROBE_S + SLACK_S)
        wait_for(lambda: second.requests_served() > served_before, timeout=10)

        dns_server.set_srv(SRV_NAME, [second.port])  # one disappears: drained, then dropped
        gone_s = seconds_until(lambda: first.url not in gateway.replicas(), timeout=INTERVAL_S + SLACK_S)
        served_after_drop = first.requests_served()
        load.wait_started(load.started + 20)  # more traffic: none of it may reach the dropped replica
        assert first.requests_served() == served_after_drop

        dns_server.set_srv(SRV_NAME, [first.port, second.port])  # and comes back
        wait_for(lambda: gateway.replicas().get(first.url, {}).get("state") == "up",
                 timeout=INTERVAL_S + PROBE_S + SLACK_S)
        load.wait_started(load.started + 20)
    finally:
        load.stop()
        outcomes = load.join()
    assert outcomes and load.failures() == []
    print(f"DNS discovery: a new replica up {appeared_s:.2f} s and a removed one dropped {gone_s:.2f} s after "
          f"the records changed (re-resolve interval {INTERVAL_S} s); {len(outcomes)} streams, none failed")


def test_sigterm_of_a_replica_under_load_never_reaches_a_client_as_503(pair: list[KvikServe],
                                                                       gateways: GatewayFactory) -> None:
    # The gateway probes every second; the replicas keep serving for 3 s after SIGTERM. Requests the
    # gateway sends before it notices (by the probe, or the header on a response) are still served.
    leaving, staying = pair
    gateway = gateways.start({"models": [model_config("tiny", [leaving, staying])],
                              "health": {"interval_s": 1.0, "timeout_s": 1.0, "unhealthy_after": 1}},
                             name="sigterm")
    key = gateway.create_key(name="sigterm")
    load = StreamLoad(gateway.url, key, total=120, concurrency=8, max_tokens=24).start()

    load.wait_started(30)
    signalled = time.monotonic()
    leaving.process.send_signal(signal.SIGTERM)
    wait_for(lambda: gateway.replicas()[leaving.url]["state"] == "draining", timeout=10, interval=0.02)
    noticed_s = time.monotonic() - signalled
    assert leaving.process.wait(timeout=60) == 0  # announced, drained, exited by itself
    outcomes = load.join()

    assert len(outcomes) == 120 and load.failures() == []
    assert gateway.metric("kvik_gateway_requests", status="503") == 0
    # Not even the gateway saw a refusal: no 503 to retry, no failure for the breaker.
    assert gateway.metric("kvik_gateway_retries") == 0
    assert gateway.metric("kvik_gateway_breaker_transitions", replica=leaving.url) == 0
    log = leaving.log()
    assert "not ready for 3.0s (still serving), then draining" in log
    assert '"status": 503' not in log  # the replica refused nothing (its per-request log lines)
    print(f"SIGTERM: the gateway took the replica out of rotation {noticed_s:.2f} s after the signal")
