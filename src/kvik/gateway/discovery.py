"""Service discovery: a model's replicas from a DNS name or from a watched file, checked again on
an interval, next to (or instead of) the fixed `replicas` of its config section.

- `dns`: every A and AAAA record of a name is a replica on the configured port (a Kubernetes
  headless Service answers with the address of each ready pod); with `srv: true` the name's SRV
  records give host and port per replica, their targets resolved to addresses the same way.
  Lookups go through dnspython, against the system's resolver configuration or the configured
  `nameservers`. NXDOMAIN and empty answers mean "no replicas" (a headless Service without ready
  pods answers NXDOMAIN); a timeout or an unreachable server keeps the last list, since one lost
  UDP packet must not drain a whole model.
- `file`: one replica URL per line; a file that cannot be read or holds a bad URL keeps the last
  list, and the log says which line to fix.

A source reports each new list to `on_found(model, source, replicas)`; the router adds replicas
(traffic after their first good probe) and drains the ones that went away.

Resolution goes through a `Resolver` (`DnsResolver` by default), so tests and other registries can
stand in for DNS.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pydantic import ValidationError

from kvik.gateway.model_config import DnsDiscoveryConfig, FileDiscoveryConfig, ModelConfig, ReplicaConfig

logger = logging.getLogger("kvik.gateway.discovery")

# (model, source, replicas found); None: the source was removed from the config.
FoundListener = Callable[[str, str, list[ReplicaConfig] | None], None]


@dataclass(slots=True, frozen=True)
class Endpoint:
    host: str  # an IP address (or a host name a resolver chose to return)
    port: int | None  # None: the configured port


class LookupFailed(Exception):
    """The name could not be looked up right now (timeout, no server answered): keep the last list."""


class Resolver(Protocol):
    async def resolve(self, name: str) -> list[Endpoint]:
        """Every endpoint behind `name`; [] when the name has none; `LookupFailed` when unknown."""
        ...


class DnsResolver:
    """A/AAAA (or SRV) lookups with dnspython's asyncio resolver."""

    def __init__(self, config: DnsDiscoveryConfig) -> None:
        import dns.asyncresolver
        import dns.nameserver

        self._srv = config.srv
        self._resolver = dns.asyncresolver.Resolver(configure=not config.nameservers)
        if config.nameservers:
            self._resolver.nameservers = [dns.nameserver.Do53Nameserver(*_host_port(server))
                                          for server in config.nameservers]
        self._resolver.lifetime = config.timeout_s

    async def resolve(self, name: str) -> list[Endpoint]:
        if not self._srv:
            return [Endpoint(address, None) for address in await self._addresses(name)]
        endpoints = []
        for record in await self._query(name, "SRV"):
            target = record.target.to_text(omit_final_dot=True)
            endpoints += [Endpoint(address, record.port) for address in await self._addresses(target)]
        return endpoints

    async def _addresses(self, name: str) -> list[str]:
        answers = await asyncio.gather(self._query(name, "A"), self._query(name, "AAAA"))
        return [record.address for answer in answers for record in answer]

    async def _query(self, name: str, rdtype: str) -> list:
        import dns.exception
        import dns.resolver

        try:
            return list(await self._resolver.resolve(name, rdtype, search=False))
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        except dns.exception.DNSException as exc:
            raise LookupFailed(f"{rdtype} {name}: {exc}") from None


def _host_port(server: str) -> tuple[str, int]:
    """"HOST", "HOST:PORT", "[V6]:PORT" or a bare IPv6 address -> (host, port); port 53 by default."""
    if server.startswith("["):
        host, _, rest = server[1:].partition("]")
        return host, int(rest.lstrip(":") or 53)
    if server.count(":") == 1:
        host, port = server.split(":")
        return host, int(port)
    return server, 53


class DnsSource:
    """One model's replicas from one DNS name, looked up every `interval_s`."""

    name = "dns"

    def __init__(self, model: str, config: DnsDiscoveryConfig, resolver: Resolver) -> None:
        self.model, self.config, self.resolver = model, config, resolver
        self._failing = False

    @property
    def interval_s(self) -> float:
        return self.config.interval_s

    async def check(self) -> list[ReplicaConfig] | None:
        """The replicas now, or None when the lookup failed (keep the last list)."""
        try:
            endpoints = await self.resolver.resolve(self.config.name)
        except LookupFailed as exc:
            if not self._failing:
                logger.warning("discovery of %s: DNS lookup failed (%s); keeping the last replica list",
                               self.model, exc)
            self._failing = True
            return None
        self._failing = False
        urls = sorted({f"{self.config.scheme}://{_url_host(e.host)}:{e.port or self.config.port}" for e in endpoints})
        return [ReplicaConfig(url=url, weight=self.config.weight, api_key=self.config.api_key) for url in urls]


def _url_host(host: str) -> str:
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host


class FileSource:
    """One model's replicas from a file of URLs, read again when its content changes."""

    name = "file"

    def __init__(self, model: str, config: FileDiscoveryConfig, base_dir: Path | None) -> None:
        self.model, self.config = model, config
        path = Path(config.path)
        self.path = path if path.is_absolute() or base_dir is None else base_dir / path
        self._digest: bytes | None = None
        self._last: list[ReplicaConfig] | None = None

    @property
    def interval_s(self) -> float:
        return self.config.interval_s

    async def check(self) -> list[ReplicaConfig] | None:
        try:
            data = await asyncio.to_thread(self.path.read_bytes)
        except OSError as exc:
            if self._digest != b"":
                logger.warning("discovery of %s: cannot read %s (%s); keeping the last replica list",
                               self.model, self.path, exc.strerror or exc)
            self._digest = b""
            return None
        digest = hashlib.sha256(data).digest()
        if digest == self._digest:
            return self._last
        self._digest = digest
        replicas = []
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
            url = line.split("#", 1)[0].strip()
            if not url:
                continue
            try:
                replicas.append(ReplicaConfig(url=url, weight=self.config.weight, api_key=self.config.api_key))
            except ValidationError as exc:
                message = exc.errors()[0]["msg"].removeprefix("Value error, ")
                logger.error("discovery of %s: %s line %d: %s; keeping the last replica list",
                             self.model, self.path, number, message)
                return None
        self._last = replicas
        return replicas


Source = DnsSource | FileSource


class Discovery:
    """The discovery sources of every model, started, changed and stopped with the config."""

    def __init__(self, on_found: FoundListener, *, base_dir: Path | None = None,
                 resolver_factory: Callable[[DnsDiscoveryConfig], Resolver] = DnsResolver) -> None:
        self._on_found = on_found
        self._base_dir = base_dir
        self._resolver_factory = resolver_factory
        self._sources: dict[tuple[str, str], tuple[Source, asyncio.Task[None]]] = {}

    async def configure(self, models: list[ModelConfig]) -> None:
        """Start the sources `models` name, stop the others; a new or changed source is checked
        once before this returns, so its replicas are known when the new config takes effect."""
        wanted: dict[tuple[str, str], Source] = {}
        for model in models:
            found = model.discovery
            if found is not None and found.dns is not None:
                wanted[(model.name, "dns")] = DnsSource(model.name, found.dns, self._resolver_factory(found.dns))
            if found is not None and found.file is not None:
                wanted[(model.name, "file")] = FileSource(model.name, found.file, self._base_dir)
        for key, (source, task) in list(self._sources.items()):
            if key not in wanted or wanted[key].config != source.config:
                task.cancel()
                del self._sources[key]
                if key not in wanted:  # a changed source's first check replaces its list instead
                    self._on_found(key[0], key[1], None)
        new = {key: source for key, source in wanted.items() if key not in self._sources}
        results = await asyncio.gather(*(source.check() for source in new.values()))
        for (key, source), replicas in zip(new.items(), results):
            if replicas is not None:
                self._on_found(source.model, source.name, replicas)
            task = asyncio.create_task(self._watch(source, replicas), name=f"kvik-discovery-{key[0]}-{key[1]}")
            self._sources[key] = (source, task)

    async def _watch(self, source: Source, last: list[ReplicaConfig] | None) -> None:
        while True:
            await asyncio.sleep(source.interval_s)
            try:
                replicas = await source.check()
            except Exception:  # a bug must not end discovery for good
                logger.exception("discovery of %s (%s) failed", source.model, source.name)
                continue
            if replicas is not None and replicas != last:
                last = replicas
                self._on_found(source.model, source.name, replicas)

    async def close(self) -> None:
        tasks = [task for _, task in self._sources.values()]
        self._sources.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
