"""The gateway configuration's `models:` entries: a model's replicas, how they are found (fixed,
DNS or a file) and balanced, and what its tokens cost. GatewayConfig (kvik.gateway.config) holds a
list of them; `Section` is the base of every section of both files (unknown keys are errors).
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class Section(BaseModel):
    # Unknown keys are errors: a typo such as `balancng:` must not silently fall back to a default.
    model_config = ConfigDict(extra="forbid", frozen=True)


class ReplicaConfig(Section):
    url: str
    weight: float = Field(default=1.0, gt=0)
    api_key: str | None = None  # sent upstream as a bearer token; `env:VAR` reads the environment

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        parsed = urlparse(value)
        if parsed.scheme == "grpc":  # kvik serve --grpc-port (plaintext; kvik.gateway.grpc_upstream)
            if not parsed.hostname or parsed.port is None or parsed.path not in ("", "/") or parsed.query:
                raise ValueError(f"{value!r}: a gRPC replica is grpc://HOST:PORT, such as grpc://127.0.0.1:50051")
            return value.rstrip("/")
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"{value!r} is not an http(s) URL such as http://127.0.0.1:8001, or grpc://HOST:PORT")
        # Stored without a trailing slash or /v1 so paths join the same way for every replica.
        value = value.rstrip("/")
        return value[: -len("/v1")] if value.endswith("/v1") else value


class PrefixAffinityConfig(Section):
    # The affine replica is skipped when it has more than `busy_factor` x the least-loaded replica's
    # outstanding requests plus `busy_slack`: a warm prefix cache is not worth a long queue.
    busy_factor: float = Field(default=2.0, ge=1)
    busy_slack: int = Field(default=4, ge=0)
    # Completions prompts have no turns; their first `prompt_prefix_chars` characters are the prefix.
    prompt_prefix_chars: int = Field(default=256, ge=1)


class PricingConfig(Section):
    # US dollars per million tokens; the admin console's cost figures use the prices set now.
    input_per_million: float = Field(default=0.0, ge=0)
    output_per_million: float = Field(default=0.0, ge=0)


class DnsDiscoveryConfig(Section):
    # Every A and AAAA record of `name` (a Kubernetes headless Service, say) is a replica on `port`;
    # with `srv: true` the SRV records of `name` give each replica's host and port instead.
    name: str = Field(min_length=1)
    port: int | None = Field(default=None, ge=1, le=65535)
    srv: bool = False
    scheme: str = "http"
    interval_s: float = Field(default=5.0, gt=0)  # re-resolved this often (record TTLs are not used)
    # "HOST" or "HOST:PORT" of the DNS servers to ask; empty: the system's (/etc/resolv.conf).
    nameservers: list[str] = []
    timeout_s: float = Field(default=2.0, gt=0)
    weight: float = Field(default=1.0, gt=0)
    api_key: str | None = None

    @model_validator(mode="after")
    def _port_known(self) -> DnsDiscoveryConfig:
        if not self.srv and self.port is None:
            raise ValueError("port: A/AAAA records carry no port; give one (or use srv: true)")
        try:  # the URLs it will make must be replica URLs
            ReplicaConfig(url=f"{self.scheme}://replica.invalid:1")
        except ValidationError as exc:
            raise ValueError(f"scheme: {exc.errors()[0]['msg'].removeprefix('Value error, ')}") from None
        return self


class FileDiscoveryConfig(Section):
    # A text file of replica URLs, one per line (blank lines and `#` comments ignored), re-read when
    # it changes; relative paths are relative to the config file.
    path: str = Field(min_length=1)
    interval_s: float = Field(default=2.0, gt=0)
    weight: float = Field(default=1.0, gt=0)
    api_key: str | None = None


class DiscoveryConfig(Section):
    dns: DnsDiscoveryConfig | None = None
    file: FileDiscoveryConfig | None = None

    @model_validator(mode="after")
    def _some_source(self) -> DiscoveryConfig:
        if self.dns is None and self.file is None:
            raise ValueError("give dns or file (or remove discovery)")
        return self


class ModelConfig(Section):
    name: str = Field(min_length=1)
    aliases: list[str] = []
    upstream_model: str | None = None  # the name the replicas know the model by (default: name)
    balancing: Literal["least_outstanding", "weighted_round_robin", "prefix_affinity"] = (
        "least_outstanding")
    prefix_affinity: PrefixAffinityConfig = Field(default_factory=PrefixAffinityConfig)
    # Fixed replicas, and/or replicas found by `discovery` (kvik.gateway.discovery); the pool is
    # the union of both.
    replicas: list[ReplicaConfig] = []
    discovery: DiscoveryConfig | None = None
    pricing: PricingConfig = Field(default_factory=PricingConfig)

    @model_validator(mode="after")
    def _has_replicas(self) -> ModelConfig:
        if not self.replicas and self.discovery is None:
            raise ValueError("replicas: give at least one replica, or a discovery section")
        return self
