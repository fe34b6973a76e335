"""Gateway configuration: the YAML file parsed into frozen pydantic models, validated once.

Every error is a `ConfigError` whose message starts with the dotted path of the offending field
(`models[0].replicas[1].url: ...`), so `kvik gateway check-config` can point at the line to fix.
Secrets may be given as `env:VAR` and are resolved at load time; a missing variable is an error
that names the field, not a silent empty string.
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from kvik.core.config_files import read_config_file
from kvik.core.errors import ConfigError
from kvik.core.tiers import DEFAULT_TIERS
from kvik.gateway.model_config import ModelConfig, ReplicaConfig
from kvik.gateway.model_config import Section as _Section

class AuthConfig(_Section):
    enabled: bool = True
    # Optional key accepted with the admin role without a database row (`env:VAR` recommended), so a
    # fresh deployment can create its first keys over the admin API.
    admin_key: str | None = None
    # Seconds a looked-up key stays in the per-process cache; revocation through another instance
    # takes effect after at most this long.
    key_cache_ttl_s: float = Field(default=5.0, ge=0)


class HealthConfig(_Section):
    interval_s: float = Field(default=5.0, gt=0)
    timeout_s: float = Field(default=2.0, gt=0)
    path: str = "/health"
    unhealthy_after: int = Field(default=2, ge=1)  # consecutive failed probes before a replica is marked down
    healthy_after: int = Field(default=1, ge=1)  # consecutive good probes before it is marked up again
    # Envoy's healthy panic threshold: when fewer than this share of a model's replicas can take
    # traffic (probes and breakers together), route to all of them instead, because failing every
    # request is worse than trying replicas that may be fine. 0 turns panic routing off.
    panic_threshold_percent: float = Field(default=50.0, ge=0, le=100)


class BreakerConfig(_Section):
    # The classic (Hystrix) settings: the breaker trips when, within `window_s`, at least
    # `volume_threshold` requests were seen and `error_threshold_percent` of them failed.
    volume_threshold: int = Field(default=20, ge=1)
    error_threshold_percent: float = Field(default=50.0, gt=0, le=100)
    window_s: float = Field(default=10.0, gt=0)
    sleep_window_s: float = Field(default=5.0, gt=0)
    half_open_probes: int = Field(default=1, ge=1)  # trial requests let through after the sleep window
    # Passive ejection: this many consecutive connect errors or 5xx trip the breaker at once, without
    # waiting for the volume threshold (a dead process should not cost 20 failed attempts).
    consecutive_failures: int = Field(default=5, ge=1)
    # Envoy's max_ejection_percent: at most this share of a model's replicas may have an open (or
    # half-open) breaker at once; at least one may when the model has two or more, never all of them.
    # 0: breakers never open.
    max_ejection_percent: float = Field(default=50.0, ge=0, le=100)


class RetryConfig(_Section):
    max_attempts: int = Field(default=3, ge=1)  # attempts per request, each on a different replica
    # Retry budget: retries over the last 10 s may not exceed this fraction of requests (plus a
    # floor), so a struggling fleet is not hit with a retry storm.
    budget_ratio: float = Field(default=0.2, ge=0)
    min_retries_per_s: float = Field(default=10.0, ge=0)


class TimeoutConfig(_Section):
    connect_s: float = Field(default=2.0, gt=0)
    # Streaming, per try: from sending the request to the first event. A replica that has sent
    # nothing by then is abandoned (its connection closed) and the request goes to another one.
    first_byte_s: float = Field(default=60.0, gt=0)
    # Longest silence between two bytes of an answer. For a non-streaming request that is the whole
    # try (nothing arrives before the generation is done), after which the request fails over; a
    # stream silent this long after its first event ends with an error event.
    read_s: float = Field(default=300.0, gt=0)


class CacheConfig(_Section):
    enabled: bool = True
    backend: Literal["auto", "memory", "redis"] = "auto"  # auto: redis when redis_url is set
    ttl_s: float = Field(default=300.0, gt=0)
    max_entries: int = Field(default=10_000, ge=1)  # memory backend
    max_bytes: int = Field(default=64 * 1024 * 1024, ge=1)  # memory backend, sum of entry sizes
    max_entry_bytes: int = Field(default=1024 * 1024, ge=1)  # larger responses are not stored
    # Entries are scoped to the tenant (the key's team, or the key) unless this is true: a shared
    # entry, and its `x-kvik-cache: hit`, tells one tenant what another asked.
    share_across_tenants: bool = False


class PiiPattern(_Section):
    name: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9_]*$")
    regex: str

    @field_validator("regex")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        return value


class PiiConfig(_Section):
    enabled: bool = False
    entities: list[Literal["email", "phone", "card", "national_id"]] = [
        "email", "phone", "card", "national_id"]
    patterns: list[PiiPattern] = []  # extra patterns, replaced by [NAME]


class ModerationConfig(_Section):
    hook: str | None = None  # "package.module:function", see guardrails/moderation.py
    timeout_s: float = Field(default=5.0, gt=0)
    # What a hook that raises or times out means: block (default; a broken filter must not silently
    # let everything through) or allow.
    fail_open: bool = False

    @field_validator("hook")
    @classmethod
    def _importable(cls, value: str | None) -> str | None:
        if value is None:
            return None
        module_name, _, function_name = value.partition(":")
        if not module_name or not function_name:
            raise ValueError(f"{value!r} must look like 'package.module:function'")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"cannot import {module_name!r}: {exc}") from None
        if not callable(getattr(module, function_name, None)):
            raise ValueError(f"{module_name!r} has no callable {function_name!r}")
        return value


class GuardrailsConfig(_Section):
    pii: PiiConfig = Field(default_factory=PiiConfig)
    moderation: ModerationConfig = Field(default_factory=ModerationConfig)


class LimitsConfig(_Section):
    # Applied to keys that have no limit of their own; null means unlimited.
    default_rpm: int | None = Field(default=None, ge=1)
    default_tpm: int | None = Field(default=None, ge=1)
    # Completion tokens reserved per choice, at admission, for a request that sets no max_tokens
    # (TPM and budgets reserve prompt + completion up front and settle the difference at the end).
    reserve_completion_tokens: int = Field(default=512, ge=1)
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    # Slow clients (slowloris): the request line and headers must arrive within header_timeout_s of
    # the request's first byte, and the body within body_timeout_s of the headers; else 408.
    header_timeout_s: float = Field(default=10.0, gt=0)
    body_timeout_s: float = Field(default=60.0, gt=0)


class MetricsConfig(_Section):
    # /metrics names every replica URL. Either give it a listener of its own (a port only the
    # scraper can reach; then it is not served on the main port) ...
    port: int | None = Field(default=None, ge=1, le=65535)
    host: str | None = None  # the metrics listener's interface (default: the gateway's host)
    # ... or, on the main port, require an admin key (`admin_key`) or nothing (`none`).
    auth: Literal["admin_key", "none"] = "admin_key"


class TenancyConfig(_Section):
    # Send each tenant's `cache_salt` upstream (an HMAC of its team or key id, overriding the
    # client's), so replicas keep tenants' prefix-cache entries apart after the shared system prompt.
    cache_salt: bool = True
    # The HMAC secret (`env:VAR`). Null: a random secret per process, so salts change on restart and
    # differ between gateway instances (a colder prefix cache, never a shared one).
    cache_salt_secret: str | None = None


class ResponsesConfig(_Section):
    # How long the gateway remembers which replica stored a Responses API response (kvik.gateway.
    # stored_responses); match the replicas' --responses-retention-days (30 by default). 0: until
    # the response is deleted through the gateway.
    retention_days: float = Field(default=30.0, ge=0, allow_inf_nan=False)


class SchedulingConfig(_Section):
    # Tier names -> the `priority` the gateway sets on every request of a key in that tier (lower is
    # served first; the server's tiers should use the same numbers). Keys without a tier get
    # `default_tier`. The tenant the server shares capacity by is the key's id.
    tiers: dict[str, int] = Field(default_factory=lambda: dict(DEFAULT_TIERS))
    default_tier: str = "standard"
    # Send `priority`, `tenant` and `tenant_weight` upstream; turn off when the replicas are not kvik
    # servers (OpenAI's own API refuses fields it does not know).
    send_fields: bool = True

    @model_validator(mode="after")
    def _default_known(self) -> SchedulingConfig:
        if self.default_tier not in self.tiers:
            raise ValueError(f"default_tier: {self.default_tier!r} is not one of the tiers "
                             f"({', '.join(self.tiers)})")
        return self


class BatchesConfig(_Section):
    # The kvik server that stores files and runs batches (/v1/files, /v1/batches) for every key;
    # each key sees only its own.
    upstream: ReplicaConfig

    @field_validator("upstream")
    @classmethod
    def _http_only(cls, value: ReplicaConfig) -> ReplicaConfig:
        if value.url.startswith("grpc://"):
            raise ValueError("the Files and Batches API is HTTP only (kvik's gRPC API carries chat and "
                             "completions); give the kvik server's http:// URL")
        return value


class TracingSection(_Section):
    # OpenTelemetry traces over OTLP/HTTP (protobuf), e.g. http://127.0.0.1:4318/v1/traces; off when
    # null. Spans: the request, auth, rate_limit, route, each upstream attempt (its traceparent goes
    # to the replica); log lines gain trace_id/span_id.
    otlp_traces_endpoint: str | None = None
    # Fraction of new traces recorded; a request arriving with a traceparent follows its sampled flag.
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)
    service_name: str = "kvik-gateway"


class ReloadConfig(_Section):
    # Re-read the config file when its content changes (polled: works with the symlink swaps of a
    # Kubernetes ConfigMap volume, which inotify misses). SIGHUP and POST /admin/config/reload
    # reload it whatever this says.
    watch: bool = True
    interval_s: float = Field(default=2.0, gt=0)


class GatewayConfig(_Section):
    models: list[ModelConfig] = Field(min_length=1)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    database_url: str = "sqlite:///gateway.db"  # relative paths are relative to the config file
    redis_url: str | None = None
    health: HealthConfig = Field(default_factory=HealthConfig)
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    retries: RetryConfig = Field(default_factory=RetryConfig)
    timeouts: TimeoutConfig = Field(default_factory=TimeoutConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    guardrails: GuardrailsConfig = Field(default_factory=GuardrailsConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    scheduling: SchedulingConfig = Field(default_factory=SchedulingConfig)
    batches: BatchesConfig | None = None
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    tenancy: TenancyConfig = Field(default_factory=TenancyConfig)
    responses: ResponsesConfig = Field(default_factory=ResponsesConfig)
    tracing: TracingSection = Field(default_factory=TracingSection)
    reload: ReloadConfig = Field(default_factory=ReloadConfig)
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=1, le=65535)

    @field_validator("database_url")
    @classmethod
    def _check_database_url(cls, value: str) -> str:
        if not value.startswith(("sqlite:///", "postgresql://", "postgres://")):
            raise ValueError(f"{value!r}: use sqlite:///PATH or postgresql://USER@HOST:PORT/DB")
        return value

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"{value!r}: use redis://HOST:PORT/DB")
        return value

    @model_validator(mode="after")
    def _names_unique(self) -> GatewayConfig:
        seen: dict[str, str] = {}
        for index, model in enumerate(self.models):
            for offset, name in enumerate([model.name, *model.aliases]):
                where = f"models[{index}].name" if offset == 0 else f"models[{index}].aliases[{offset - 1}]"
                if name in seen:
                    raise ValueError(f"{where}: {name!r} is already used by {seen[name]}")
                seen[name] = where
        if self.cache.backend == "redis" and self.redis_url is None:
            raise ValueError("cache.backend: 'redis' needs redis_url")
        if self.metrics.port is not None and self.metrics.port == self.port:
            raise ValueError("metrics.port: must differ from port (or be null to serve /metrics on the main port)")
        return self


def load_config(path: str | os.PathLike[str], *, overrides: dict[str, Any] | None = None) -> GatewayConfig:
    """Read, validate and resolve a gateway YAML file; raise `ConfigError` naming the bad field."""
    path = Path(path)
    raw = read_config_file(path)
    raw.update(overrides or {})
    return parse_config(raw, base_dir=path.parent)


def parse_config(raw: dict[str, Any], *, base_dir: Path | None = None) -> GatewayConfig:
    """Validate a config mapping (as read from YAML); `env:VAR` secrets are resolved here."""
    try:
        config = GatewayConfig.model_validate(_resolve_env(raw, ""))
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc)) from None
    if base_dir is not None and config.database_url.startswith("sqlite:///"):
        db_path = Path(config.database_url[len("sqlite:///"):])
        if not db_path.is_absolute() and str(db_path) != ":memory:":
            config = config.model_copy(update={"database_url": f"sqlite:///{(base_dir / db_path).resolve()}"})
    return config


_SECRET_FIELDS = ("api_key", "admin_key", "database_url", "redis_url", "cache_salt_secret")


def _resolve_env(node: Any, where: str) -> Any:
    """Replace `env:VAR` in secret-bearing fields by the variable's value."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            field = f"{where}.{key}" if where else str(key)
            if key in _SECRET_FIELDS and isinstance(value, str) and value.startswith("env:"):
                var = value[len("env:"):]
                if var not in os.environ:
                    raise ConfigError(f"{field}: environment variable {var} is not set")
                value = os.environ[var]
            out[key] = _resolve_env(value, field)
        return out
    if isinstance(node, list):
        return [_resolve_env(item, f"{where}[{i}]") for i, item in enumerate(node)]
    return node


# "field: message" from a model validator (the field is inside the section the error is located at).
_NAMED_FIELD = re.compile(r"([a-z_][a-z0-9_]*): ")


def _format_validation_error(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        path = ""
        for part in error["loc"]:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown field (check the spelling)"
        named = _NAMED_FIELD.match(message)
        if path and named:  # a section's own check that names one of its fields: join the paths
            path, message = f"{path}.{named.group(1)}", message[named.end():]
        lines.append(f"{path}: {message}" if path else message)
    return "; ".join(lines)
