"""Which requests the response cache may answer, and the key they are stored under.

Only deterministic requests are cached: temperature 0 (greedy) or a fixed `seed`, and embeddings,
which do not sample. A request without a temperature samples at temperature 1 (the OpenAI default),
so it is never cached unless it fixes a seed. Clients opt out with `x-kvik-cache: no-store` or
`Cache-Control: no-store` (neither read nor written) or `Cache-Control: no-cache` (not read, but
the fresh answer is stored).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Fields that do not change the answer: two requests differing only here share an entry.
_IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier"})


@dataclass(slots=True, frozen=True)
class CacheDirective:
    read: bool  # may the answer come from the cache
    write: bool  # may the fresh answer be stored


NO_CACHE = CacheDirective(read=False, write=False)


def is_deterministic(body: Mapping[str, Any]) -> bool:
    temperature = body.get("temperature", 1.0)
    return temperature == 0 or body.get("seed") is not None


def directive(body: Mapping[str, Any], headers: Mapping[str, str], *, sampled: bool = True) -> CacheDirective:
    """`sampled` False for an endpoint whose answer does not depend on sampling (embeddings)."""
    if sampled and not is_deterministic(body):
        return NO_CACHE
    cache_control = headers.get("cache-control", "").lower()
    if headers.get("x-kvik-cache", "").lower() == "no-store" or "no-store" in cache_control:
        return NO_CACHE
    return CacheDirective(read="no-cache" not in cache_control, write=True)


def cache_key(endpoint: str, model: str, body: Mapping[str, Any], *, tenant: str | None) -> str:
    """SHA-256 of the tenant and the normalised request: canonical model name (aliases share
    entries), sorted keys, no whitespace, answer-neutral fields dropped. `stream` stays in: the wire
    format differs. `tenant` None shares the entry across tenants (an explicit opt-in)."""
    normalised = {k: v for k, v in body.items() if k not in _IGNORED_FIELDS}
    normalised["model"] = model
    # ASCII escapes: a lone surrogate (valid JSON, `"\ud800"`) has no UTF-8 encoding.
    material = json.dumps([tenant, endpoint, normalised], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(material.encode()).hexdigest()
