"""The live replica set without processes: reload diffs on the router, drain then drop, discovery
sources (with a stand-in resolver, and dnspython against a real DNS server on 127.0.0.1), and the
validation of the new config sections. The end-to-end versions are in test_e2e_rollout.py and
test_e2e_reload.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvik.core.errors import ConfigError
from kvik.gateway.balancing import RoutingContext
from kvik.gateway.breaker import BreakerState
from kvik.gateway.config import GatewayConfig, parse_config
from kvik.gateway.model_config import DnsDiscoveryConfig, FileDiscoveryConfig
from kvik.gateway.discovery import DnsResolver, DnsSource, Endpoint, FileSource, LookupFailed
from kvik.gateway.reload import _keep_restart_only
from kvik.gateway.replica import Outcome
from kvik.gateway.router import ModelRouter
from tests.gateway.dns_server import TestDnsServer

A, B, C = "http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"


def config(*urls: str, **extra) -> GatewayConfig:
    return parse_config({"models": [{"name": "m", "replicas": [{"url": u} for u in urls]}], **extra})


def test_reload_keeps_state_of_kept_replicas_probes_new_ones_and_drains_removed_ones() -> None:
    dropped = []
    router = ModelRouter(config(A, B), on_dropped=dropped.append)
    pool = router.resolve("m")
    a, b = pool.replicas
    for _ in range(5):  # consecutive failures open A's breaker
        a.begin_attempt()
        a.finish_attempt(Outcome.FAILURE)
    assert a.breaker.state is BreakerState.OPEN
    b.begin_attempt()  # a stream in flight on B

    change = router.apply(config(A, C))
    assert [r.url for r in change.added] == [C] and change.retired == [b]
    assert pool.replicas[0] is a and a.breaker.state is BreakerState.OPEN  # same object, same breaker
    c = pool.replicas[1]
    assert c.awaiting_probe and not c.is_available()
    # No replica is available, so panic routing tries A anyway; never the unprobed C or the retired B.
    assert {pool.pick(RoutingContext()) for _ in range(10)} == {a}
    assert b.retired and router.retiring == [b] and not dropped
    b.finish_attempt(Outcome.SUCCESS)  # its last stream ends: dropped
    assert router.retiring == [] and dropped == [b]


def test_a_replica_that_announces_its_drain_leaves_rotation_without_a_breaker_failure() -> None:
    router = ModelRouter(config(A, B))
    pool = router.resolve("m")
    a, b = pool.replicas
    a.announce_drain("a response")
    assert {pool.pick(RoutingContext()) for _ in range(10)} == {b}
    assert a.breaker.state is BreakerState.CLOSED and a.healthy


def test_models_and_aliases_change_live() -> None:
    router = ModelRouter(config(A))
    new = parse_config({"models": [{"name": "m", "aliases": ["m-latest"], "replicas": [{"url": A}]},
                                   {"name": "n", "replicas": [{"url": B}]}]})
    change = router.apply(new)
    assert change.models_added == ["n"] and router.resolve("m-latest") is router.resolve("m")
    change = router.apply(config(A))
    assert change.models_removed == ["n"]
    with pytest.raises(Exception, match="does not exist"):
        router.resolve("n")


def test_settings_that_need_a_restart_keep_their_running_value() -> None:
    old = config(A)
    new = config(B, port=9999, limits={"max_body_bytes": 4096, "default_rpm": 10})
    effective, restart = _keep_restart_only(old, new)
    assert restart == ["port", "limits.max_body_bytes"]
    assert effective.port == old.port and effective.limits.max_body_bytes == old.limits.max_body_bytes
    assert effective.limits.default_rpm == 10 and effective.models[0].replicas[0].url == B


class StandInResolver:
    """What a test resolver looks like: a list the test edits, or an outage."""

    def __init__(self) -> None:
        self.endpoints: list[Endpoint] = []
        self.failing = False

    async def resolve(self, name: str) -> list[Endpoint]:
        if self.failing:
            raise LookupFailed("timed out")
        return list(self.endpoints)


def test_dns_source_follows_the_resolver_and_keeps_the_last_list_when_lookups_fail() -> None:
    resolver = StandInResolver()
    source = DnsSource("m", DnsDiscoveryConfig(name="replicas.test", port=8000), resolver)
    resolver.endpoints = [Endpoint("10.0.0.2", None), Endpoint("fd00::1", None)]
    found = asyncio.run(source.check())
    assert [r.url for r in found] == ["http://10.0.0.2:8000", "http://[fd00::1]:8000"]
    resolver.failing = True
    assert asyncio.run(source.check()) is None  # None: keep what the pool has
    resolver.failing, resolver.endpoints = False, []
    assert asyncio.run(source.check()) == []  # the name has no replica now: all drain


def test_discovered_replicas_join_and_leave_the_pool() -> None:
    router = ModelRouter(parse_config({"models": [{"name": "m", "discovery": {"file": {"path": "x"}}}]}))
    assert router.resolve("m").replicas == []
    change = router.set_discovered("m", "file", [*config(A, B).models[0].replicas])
    assert [r.url for r in change.added] == [A, B] and all(r.awaiting_probe for r in change.added)
    change = router.set_discovered("m", "file", [*config(B).models[0].replicas])
    assert [r.url for r in change.retired] == [A] and router.retiring == []  # idle: dropped at once


def test_dnspython_against_a_real_dns_server() -> None:
    server = TestDnsServer().start()
    try:
        server.set("replicas.kvik.test", "A", ["127.0.0.1", "127.0.0.2"])
        server.set("replicas.kvik.test", "AAAA", ["::1"])
        server.set_srv("_http._tcp.replicas.kvik.test", [8001, 8002])
        plain = DnsResolver(DnsDiscoveryConfig(name="x", port=1, nameservers=[server.nameserver]))
        assert sorted(e.host for e in asyncio.run(plain.resolve("replicas.kvik.test"))) == \
            ["127.0.0.1", "127.0.0.2", "::1"]
        assert asyncio.run(plain.resolve("gone.kvik.test")) == []  # NXDOMAIN: no replicas
        srv = DnsResolver(DnsDiscoveryConfig(name="x", srv=True, nameservers=[server.nameserver]))
        assert sorted((e.host, e.port) for e in asyncio.run(srv.resolve("_http._tcp.replicas.kvik.test"))) == \
            [("127.0.0.1", 8001), ("127.0.0.1", 8002)]
    finally:
        server.stop()
    unreachable = DnsResolver(DnsDiscoveryConfig(name="x", port=1, nameservers=[server.nameserver], timeout_s=0.3))
    with pytest.raises(LookupFailed):
        asyncio.run(unreachable.resolve("replicas.kvik.test"))


def test_file_source_reads_urls_and_keeps_the_last_list_on_a_bad_line(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    listing = tmp_path / "replicas.txt"
    listing.write_text(f"# the fleet\n{A}/v1\n\n{B}  # second\n")
    source = FileSource("m", FileDiscoveryConfig(path="replicas.txt"), tmp_path)
    assert [r.url for r in asyncio.run(source.check())] == [A, B]
    listing.write_text(f"{A}\nftp://nope\n")
    assert asyncio.run(source.check()) is None
    assert "replicas.txt line 2" in caplog.text


@pytest.mark.parametrize(("section", "expected"), [
    ({"dns": {"name": "r.test"}}, "models[0].discovery.dns.port: A/AAAA records carry no port"),
    ({"dns": {"name": "r.test", "port": 80, "scheme": "ftp"}}, "models[0].discovery.dns.scheme"),
    ({}, "models[0].discovery: give dns or file"),
])
def test_discovery_config_errors_name_the_field(section: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"models": [{"name": "m", "discovery": section}]})
    assert expected in info.value.message


def test_a_model_needs_replicas_or_discovery() -> None:
    with pytest.raises(ConfigError, match=r"models\[0\].replicas: give at least one replica"):
        parse_config({"models": [{"name": "m"}]})
