"""Priority tiers: names for the `priority` values the scheduler orders by (lower is served first).

The engine knows only numbers. The gateway gives each API key a tier and sets the request's
`priority` from it; the server names tiers in its metrics and runs Batch API work in the background
tier. Both read the same mapping, by default:

    interactive = -10   chat and other latency-sensitive traffic
    standard    =   0   the default of a request that names no priority (as vLLM's)
    background  =  10   batch jobs and bulk work: only capacity the others leave idle
"""

from __future__ import annotations

from kvik.core.errors import ConfigError

DEFAULT_TIERS: dict[str, int] = {"interactive": -10, "standard": 0, "background": 10}
BACKGROUND = "background"
# Metrics label of a priority that matches no configured tier (keeps label values bounded).
OTHER_TIER = "other"


def parse_tiers(text: str) -> dict[str, int]:
    """'interactive=-10,standard=0,background=10' -> {name: priority}."""
    tiers: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"priority tiers: {item!r} is not NAME=PRIORITY (e.g. background=10)")
        try:
            tiers[name] = int(value)
        except ValueError:
            raise ConfigError(f"priority tiers: {item!r}: the priority must be an integer") from None
    if not tiers:
        raise ConfigError("priority tiers: give at least one NAME=PRIORITY")
    if len(set(tiers.values())) != len(tiers):
        raise ConfigError("priority tiers: two tiers share a priority; give each its own")
    return tiers


def tier_name(priority: int, tiers: dict[str, int]) -> str:
    for name, value in tiers.items():
        if value == priority:
            return name
    return OTHER_TIER


def background_priority(tiers: dict[str, int]) -> int:
    """The background tier's priority, or the worst configured one."""
    return tiers.get(BACKGROUND, max(tiers.values()))
