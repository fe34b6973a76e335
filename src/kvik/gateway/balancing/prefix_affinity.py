"""Prefix affinity: the turns of one conversation go to the same replica, so its prefix cache
(the KV blocks of the shared system prompt and earlier turns) is hit.

The replica for a prefix is chosen by weighted rendezvous hashing over all replicas of the model:
stable while replicas come and go (only the prefixes of a removed replica move). When the affine
replica is unavailable, or much busier than the least-loaded one, the request goes to the
least-loaded replica instead: a warm cache does not pay for a long queue.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence

from kvik.gateway.balancing.base import BalancingStrategy, RoutingContext
from kvik.gateway.balancing.least_outstanding import Rotation, least_loaded
from kvik.gateway.model_config import PrefixAffinityConfig
from kvik.gateway.replica import Replica


class PrefixAffinity(BalancingStrategy):
    name = "prefix_affinity"

    def __init__(self, replicas: Sequence[Replica], config: PrefixAffinityConfig) -> None:
        super().__init__(replicas)
        self._config = config
        self._rotation = Rotation()

    def choose(self, candidates: Sequence[Replica], context: RoutingContext) -> Replica:
        fallback = least_loaded(candidates, self._rotation)
        if context.affinity_key is None:
            return fallback
        affine = self.affine_replica(context.affinity_key)
        if affine not in candidates:
            return fallback
        busy_limit = fallback.outstanding * self._config.busy_factor + self._config.busy_slack
        return fallback if affine.outstanding > busy_limit else affine

    def affine_replica(self, affinity_key: str) -> Replica:
        """Highest weighted score `-weight / ln(u)`, u uniform from hash(key, replica)."""
        def score(replica: Replica) -> float:
            digest = hashlib.blake2b(f"{affinity_key}|{replica.url}".encode(), digest_size=8).digest()
            unit = (int.from_bytes(digest, "big") + 1) / (2**64 + 1)  # in (0, 1)
            return -replica.weight / math.log(unit)

        return max(self.replicas, key=score)


def affinity_key(body: dict, prompt_prefix_chars: int) -> str | None:
    """Hash of the conversation prefix: chat messages up to and including the first user turn (what
    every later turn of the conversation repeats), or the head of a completions prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        prefix = []
        for message in messages:
            prefix.append(message)
            if isinstance(message, dict) and message.get("role") == "user":
                break
        material = json.dumps(prefix, sort_keys=True, default=str)
    elif isinstance(body.get("prompt"), str):
        material = body["prompt"][:prompt_prefix_chars]
    else:
        return None
    return hashlib.blake2b(material.encode(), digest_size=16).hexdigest()
