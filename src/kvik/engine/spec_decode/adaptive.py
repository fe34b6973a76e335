"""How many drafts to propose for a sequence, from how many it has had accepted lately.

Treat each draft as accepted with probability a (independently): k drafts then yield
(1 - a^(k+1)) / (1 - a) tokens per verification, at a cost of 1 + f + c k target steps, where f is
a verification's fixed overhead (proposing, scoring the rows, the bookkeeping) and c the cost of
one draft token (its verification row, plus the draft model's step), both relative to a decode
step. Each step proposes the k in 0..max_k with the most tokens per cost; k = 0 (off) whenever no
k pays for itself (for k = 1: whenever a <= f + c). While off, the sequence is probed again with one
draft after a back-off that doubles on every failed probe (8, 16, ... 256 steps), so a sequence that
starts copying later gets speculation back, and one that never does costs almost nothing.

a is estimated from accept/reject counts that decay by DECAY per verification (a window of about
five), starting from a prior that depends on the proposer (`decoder.PRIOR_ACCEPTANCE`: 2 of 3
accepted for the n-gram lookup, 0.8 for a draft model). The choice depends only on the sequence's own
history, never on timing or the batch, so seeded requests stay reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.8
FIRST_BACKOFF = 8
MAX_BACKOFF = 256


@dataclass(slots=True)
class AdaptiveK:
    max_k: int
    cost_per_draft: float  # c: one draft token's cost relative to one decode step of the target
    cost_fixed: float = 0.0  # f: a verification's fixed overhead, relative to one decode step
    enabled: bool = True  # False: always propose max_k (tests, benchmarks of a fixed k)
    accepted: float = 2.0  # decayed counts of accepted and rejected drafts
    rejected: float = 1.0
    steps_off: int = 0  # steps left before the next probe
    backoff: int = FIRST_BACKOFF

    @classmethod
    def with_prior(cls, max_k: int, cost_per_draft: float, cost_fixed: float, enabled: bool,
                   prior: float, weight: float = 3.0) -> AdaptiveK:
        """Start from `prior` acceptance, as if `weight` drafts had been verified."""
        return cls(max_k, cost_per_draft, cost_fixed, enabled, accepted=prior * weight,
                   rejected=(1 - prior) * weight)

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def next_k(self) -> int:
        """Drafts to propose for the coming step (0: none)."""
        if not self.enabled:
            return self.max_k
        if self.steps_off > 0:
            self.steps_off -= 1
            return 1 if self.steps_off == 0 else 0  # the probe
        k = best_k(self.acceptance, self.max_k, self.cost_per_draft, self.cost_fixed)
        if k == 0:
            self.steps_off = self.backoff
            self.backoff = min(2 * self.backoff, MAX_BACKOFF)
        return k

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        """One verification: the drafts were accepted up to the first rejection."""
        self.accepted = DECAY * self.accepted + num_accepted
        self.rejected = DECAY * self.rejected + (num_accepted < num_proposed)
        if best_k(self.acceptance, self.max_k, self.cost_per_draft, self.cost_fixed) > 0:
            self.backoff = FIRST_BACKOFF


def best_k(acceptance: float, max_k: int, cost_per_draft: float, cost_fixed: float = 0.0) -> int:
    """argmax over k of expected tokens per verification over its cost (0 when nothing pays)."""
    best, best_rate = 0, 1.0
    for k in range(1, max_k + 1):
        tokens = k + 1 if acceptance >= 1.0 else (1 - acceptance ** (k + 1)) / (1 - acceptance)
        rate = tokens / (1 + cost_fixed + cost_per_draft * k)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best
