"""Virtual token counters: fair share of served tokens between tenants of one priority tier.

The Virtual Token Counter (VTC) of Sheng et al., "Fairness in Serving Large Language Models" (OSDI
2024): every tenant has a counter of the service it received, in weighted tokens (prompt tokens
count `input_weight`, generated tokens `output_weight`, both divided by the tenant's weight). The
scheduler admits the waiting request of the tenant with the smallest counter, so a tenant that
sends ten times the requests does not get ten times the tokens while others wait: each backlogged
tenant gets at least its weighted share of the capacity, up to a bounded lag.

Idle time is not banked: a tenant that (re)joins with work is lifted to the smallest counter among
the tenants that have work in its tier (or, when none has, to the counter of the last one that
left), so it competes as an equal from now on instead of monopolising the tier to "catch up".

Counters are kept per (priority, tenant): fair share applies within a tier; tiers are strictly
ordered by priority. Pure bookkeeping, no clock: the scheduler calls `join`, `charge` and `leave`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Weights of the paper's default setting: a generated token costs about twice a prompt token.
DEFAULT_INPUT_WEIGHT = 1.0
DEFAULT_OUTPUT_WEIGHT = 2.0
# Idle tenants whose counter is at or below the lift floor are forgotten past this many counters
# per tier (they would be lifted to the floor on return anyway, so nothing is lost).
MAX_IDLE_TENANTS = 4096


@dataclass(slots=True)
class _Tier:
    counters: dict[str, float] = field(default_factory=dict)  # weighted tokens served
    pending: dict[str, int] = field(default_factory=dict)  # unfinished sequences (waiting or running)
    weights: dict[str, float] = field(default_factory=dict)
    last_left: float = 0.0  # counter of the last tenant whose work ran out

    def floor(self) -> float:
        active = [self.counters[tenant] for tenant in self.pending]
        return min(active) if active else self.last_left


class VirtualTokenCounters:
    def __init__(self, input_weight: float = DEFAULT_INPUT_WEIGHT,
                 output_weight: float = DEFAULT_OUTPUT_WEIGHT) -> None:
        self.input_weight = input_weight
        self.output_weight = output_weight
        self._tiers: dict[int, _Tier] = {}

    def join(self, priority: int, tenant: str, weight: float = 1.0) -> None:
        """A sequence of `tenant` arrived. A tenant with no other work in the tier is lifted to the
        tier's floor, so time spent idle is not credit."""
        tier = self._tiers.setdefault(priority, _Tier())
        if tenant not in tier.pending:
            tier.counters[tenant] = max(tier.counters.get(tenant, 0.0), tier.floor())
            tier.pending[tenant] = 0
            if len(tier.counters) > MAX_IDLE_TENANTS:
                self._forget_idle(tier)
        tier.pending[tenant] += 1
        tier.weights[tenant] = weight

    def leave(self, priority: int, tenant: str) -> None:
        """A sequence of `tenant` finished (or was aborted)."""
        tier = self._tiers.get(priority)
        if tier is None or tenant not in tier.pending:
            return
        tier.pending[tenant] -= 1
        if tier.pending[tenant] <= 0:
            del tier.pending[tenant]
            tier.last_left = tier.counters[tenant]

    def charge_prompt(self, priority: int, tenant: str, num_tokens: int) -> None:
        self._charge(priority, tenant, num_tokens * self.input_weight)

    def charge_output(self, priority: int, tenant: str, num_tokens: int) -> None:
        self._charge(priority, tenant, num_tokens * self.output_weight)

    def counter(self, priority: int, tenant: str) -> float:
        tier = self._tiers.get(priority)
        return 0.0 if tier is None else tier.counters.get(tenant, 0.0)

    def _charge(self, priority: int, tenant: str, cost: float) -> None:
        tier = self._tiers.get(priority)
        if tier is None or tenant not in tier.counters:
            return
        tier.counters[tenant] += cost / tier.weights.get(tenant, 1.0)

    @staticmethod
    def _forget_idle(tier: _Tier) -> None:
        floor = tier.floor()
        for tenant in [t for t, c in tier.counters.items() if t not in tier.pending and c <= floor]:
            del tier.counters[tenant]
            tier.weights.pop(tenant, None)
