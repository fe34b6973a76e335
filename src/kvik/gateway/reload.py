"""Configuration reload without a restart, and the replica set that follows it and discovery.

Three triggers read the config file again: a change of its content (polled every
`reload.interval_s`, so the symlink swap of a Kubernetes ConfigMap volume is seen), SIGHUP, and
`POST /admin/config/reload`. A reload validates the whole file first; a file that fails keeps the
running config, and the error names the field (logged, and the admin API's 400).

Applied live: models (added, removed, aliases, upstream names, balancing, pricing), their replicas
and discovery, the admin key and the rest of `auth`, health probes, breaker thresholds, retries,
timeouts, default rate limits, guardrails and scheduling tiers. Replicas that stay keep their
breaker, load and health; new ones take traffic after their first good probe; removed ones drain
(no new requests, the ones in flight finish, streams included) and are then dropped.

Everything else is bound at start-up (`RESTART_ONLY`): a change is logged and reported, and the old
value keeps serving until the gateway restarts.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from kvik.core.errors import ConfigError
from kvik.gateway.config import GatewayConfig, load_config
from kvik.gateway.model_config import ReplicaConfig
from kvik.gateway.discovery import Discovery
from kvik.gateway.guardrails.moderation import ModerationHook
from kvik.gateway.guardrails.pii import PiiRedactor
from kvik.gateway.replica import Replica
from kvik.gateway.router import MembershipChange

if TYPE_CHECKING:
    from kvik.gateway.state import GatewayState

logger = logging.getLogger("kvik.gateway.reload")

# Top-level settings bound at start-up: listeners, storage, the cache, exporters, tenancy secrets.
RESTART_ONLY = ("host", "port", "database_url", "redis_url", "cache", "metrics", "tracing", "tenancy", "batches")
# Settings of `limits` the HTTP layer reads once (the middleware and the protocol class).
LIMITS_RESTART_ONLY = ("max_body_bytes", "header_timeout_s", "body_timeout_s")


@dataclass(slots=True)
class ReloadResult:
    """What one reload did; the admin API returns it as JSON."""

    source: str
    changed: list[str] = field(default_factory=list)  # top-level settings applied
    restart_required: list[str] = field(default_factory=list)  # changed, but in effect only after a restart
    models_added: list[str] = field(default_factory=list)
    models_removed: list[str] = field(default_factory=list)
    replicas_added: list[dict[str, Any]] = field(default_factory=list)
    replicas_draining: list[dict[str, Any]] = field(default_factory=list)  # with their in-flight count

    def to_dict(self) -> dict[str, Any]:
        return {"object": "config.reload", "source": self.source, "changed": self.changed,
                "restart_required": self.restart_required, "models_added": self.models_added,
                "models_removed": self.models_removed, "replicas_added": self.replicas_added,
                "replicas_draining": self.replicas_draining}


class ConfigReloader:
    """Owns the live config of one gateway: reloads, the file watch, and discovery."""

    def __init__(self, state: GatewayState, path: Path | None) -> None:
        self._state = state
        self.path = path  # None: the config did not come from a file (nothing to reload)
        self.discovery = Discovery(self._discovered, base_dir=path.parent if path is not None else None)
        self._lock = asyncio.Lock()
        self._digest: bytes | None = None  # of the file content last loaded or refused
        self._watch_task: asyncio.Task[None] | None = None
        self._background: asyncio.Task[None] | None = None  # a signal's reload, referenced until done

    async def start(self) -> None:
        await self.discovery.configure(self._state.config.models)
        if self.path is not None:
            self._digest = await asyncio.to_thread(self._file_digest)
            self._watch_task = asyncio.create_task(self._watch(), name="kvik-gateway-config-watch")

    async def close(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
            await asyncio.gather(self._watch_task, return_exceptions=True)
        await self.discovery.close()

    async def reload(self, source: str) -> ReloadResult:
        """Read, validate and apply the config file; `ConfigError` (old config kept) if it is bad."""
        if self.path is None:
            raise ConfigError("this gateway was not started from a config file; there is nothing to reload")
        async with self._lock:
            self._digest = await asyncio.to_thread(self._file_digest)
            try:
                new = await asyncio.to_thread(load_config, self.path)
            except ConfigError as exc:
                logger.error("config reload (%s) refused, the running config stays: %s: %s",
                             source, self.path, exc.message)
                raise
            result = await self._apply(new, source)
        logger.warning("config reloaded (%s): changed %s%s", source, ", ".join(result.changed) or "nothing",
                       f"; needs a restart: {', '.join(result.restart_required)}" if result.restart_required else "")
        return result

    def reload_in_background(self, source: str) -> None:
        """For signal handlers: reload, logging (not raising) a bad file."""
        self._background = asyncio.get_running_loop().create_task(self._reload_logged(source))

    async def _reload_logged(self, source: str) -> None:
        try:
            await self.reload(source)
        except ConfigError:
            pass  # logged by reload()
        except Exception:
            logger.exception("config reload (%s) failed; the running config stays", source)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._state.config.reload.interval_s)
            if not self._state.config.reload.watch:
                continue
            digest = await asyncio.to_thread(self._file_digest)
            if digest is not None and digest != self._digest:
                await self._reload_logged("file change")

    def _file_digest(self) -> bytes | None:
        assert self.path is not None
        try:
            return hashlib.sha256(self.path.read_bytes()).digest()
        except OSError:
            return None  # being replaced; look again next time

    async def _apply(self, new: GatewayConfig, source: str) -> ReloadResult:
        state = self._state
        old = state.config
        effective, restart = _keep_restart_only(old, new)
        result = ReloadResult(source, restart_required=restart)
        result.changed = [name for name in GatewayConfig.model_fields
                          if getattr(old, name) != getattr(effective, name)]
        for name in restart:
            logger.warning("config reload (%s): %s changed, but takes effect only after a restart", source, name)
        # New discovery sources are looked up first, so their models start with replicas.
        await self.discovery.configure(effective.models)
        # From here on nothing awaits: no request sees half of the new config.
        change = state.router.apply(effective)
        state.auth.reconfigure(effective.auth)
        state.prober.config = effective.health
        state.proxy.reconfigure(effective.retries, effective.timeouts)
        state.client.timeout = httpx.Timeout(effective.timeouts.read_s, connect=effective.timeouts.connect_s)
        state.limiter.reconfigure(effective.limits)
        if effective.guardrails != old.guardrails:
            pii, moderation = effective.guardrails.pii, effective.guardrails.moderation
            state.redactor = PiiRedactor(pii) if pii.enabled else None
            state.moderation = ModerationHook(moderation) if moderation.hook else None
        state.scheduling.config = effective.scheduling
        state.config = effective
        self._applied(change, source)
        result.models_added, result.models_removed = change.models_added, change.models_removed
        result.replicas_added = [_describe(r) for r in change.added]
        result.replicas_draining = [_describe(r) for r in change.retired]
        return result

    def _discovered(self, model: str, source: str, replicas: list[ReplicaConfig] | None) -> None:
        self._applied(self._state.router.set_discovered(model, source, replicas), f"discovery of {model} ({source})")

    def _applied(self, change: MembershipChange, source: str) -> None:
        for replica in change.added:
            logger.warning("replica %s of %s added (%s); it takes traffic after a good health probe",
                           replica.url, replica.model, source)
        self._state.prober.probe_now(change.added)


def _keep_restart_only(old: GatewayConfig, new: GatewayConfig) -> tuple[GatewayConfig, list[str]]:
    """`new` with the settings that need a restart put back to the running ones, and their names."""
    changed = [name for name in RESTART_ONLY if getattr(old, name) != getattr(new, name)]
    changed += [f"limits.{name}" for name in LIMITS_RESTART_ONLY
                if getattr(old.limits, name) != getattr(new.limits, name)]
    limits = new.limits.model_copy(update={name: getattr(old.limits, name) for name in LIMITS_RESTART_ONLY})
    update: dict[str, Any] = {name: getattr(old, name) for name in RESTART_ONLY}
    return new.model_copy(update={**update, "limits": limits}), changed


def _describe(replica: Replica) -> dict[str, Any]:
    return {"model": replica.model, "url": replica.url, "outstanding": replica.outstanding}
