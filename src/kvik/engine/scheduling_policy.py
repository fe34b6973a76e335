"""Who is admitted first and who gives way: the scheduler's queue policy, one class per policy.

The scheduler (`kvik.engine.scheduler`) owns the mechanics (token budget, blocks, preemption); a
policy answers four questions at its decision points:

- `admission_order`: in which order waiting sequences are offered a place in the batch;
- `running_key`: the order of the running batch, whose last member is preempted first when blocks
  run out;
- `may_displace`: whether a waiting sequence may take the place of a running one (preempt it for a
  batch slot or blocks, or push its chunk to the next step for token budget);
- `prefill_chunk_limit`: the most prompt tokens a sequence may compute in one step;
- accounting hooks (`on_add`, `on_admit`, `on_output`, `on_leave`) for policies that keep state.

`fcfs`: arrival order; the newest running sequence is preempted first; nobody displaces anybody.

`priority` (the default): vLLM's `priority` (lower value first). Tiers are strict: a waiting
sequence of a better tier displaces running sequences of worse tiers (lowest priority first, then
newest), so a background tier only ever runs on capacity the others leave idle and never delays
their admission. Within a tier, tenants share by tokens served (virtual token counters,
`kvik.engine.fair_share`): the waiting sequence of the tenant with the smallest counter goes
first, each tenant's own sequences in arrival order. With every request at priority 0 and no
tenant it admits exactly as `fcfs`. With `lower_tier_prefill_chunk` (`--lower-tier-prefill-chunk`,
16 by default on a CPU), a tier worse than one that sent a request within the last 30 s prefills at
most that many tokens a step, so a better tier's arrival never waits behind a long step of
worse-tier prefill.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

from kvik.engine.fair_share import VirtualTokenCounters
from kvik.engine.request import Request

POLICIES = ("fcfs", "priority")
ACTIVE_WINDOW_S = 30.0  # a tier counts as active this long after its latest request
DEFAULT_CPU_LOWER_TIER_PREFILL_CHUNK = 16  # make_policy's choice on a CPU when none is given


class FcfsPolicy:
    name = "fcfs"

    def admission_order(self, waiting: Iterable[Request]) -> Iterator[Request]:
        """Arrival order (preempted sequences are back in the queue at their arrival position)."""
        return iter(list(waiting))

    @staticmethod
    def running_key(request: Request) -> Any:
        return request.arrival_order

    def may_displace(self, candidate: Request, running: Request) -> bool:
        return False

    def prefill_chunk_limit(self, request: Request) -> int | None:
        """The most prompt tokens `request` may compute in one step (None: the step budget's)."""
        return None

    def on_add(self, request: Request) -> None:
        pass

    def on_admit(self, request: Request, num_prompt_tokens: int) -> None:
        pass

    def on_output(self, request: Request, num_tokens: int) -> None:
        pass

    def on_leave(self, request: Request) -> None:
        pass


class PriorityFairPolicy(FcfsPolicy):
    name = "priority"

    def __init__(self, counters: VirtualTokenCounters | None = None, *, lower_tier_prefill_chunk: int | None = None,
                 active_window_s: float = ACTIVE_WINDOW_S) -> None:
        self.counters = counters or VirtualTokenCounters()
        self._prompt_charged: set[str] = set()  # seq ids whose prompt was charged (once, not per recompute)
        # A step cannot be interrupted, so a request of a better tier that arrives while a worse
        # tier's long prefill chunk runs waits for all of it (on a CPU, about 2 ms a token for the
        # 125M reference model). While a better tier has sent anything within the window, worse
        # tiers prefill at most this many tokens a step: the wait is then about one short step.
        self.lower_tier_prefill_chunk = lower_tier_prefill_chunk
        self.active_window_s = active_window_s
        self._last_arrival: dict[int, float] = {}  # priority -> time.monotonic() of its latest request

    def admission_order(self, waiting: Iterable[Request]) -> Iterator[Request]:
        """Best tier first; within it, the head of the tenant with the smallest virtual counter,
        re-chosen after every admission (admitting charges the counter)."""
        tiers: dict[int, dict[str, deque[Request]]] = {}
        for request in waiting:  # arrival order
            group = request.group
            tiers.setdefault(group.priority, {}).setdefault(group.tenant, deque()).append(request)
        counter = self.counters.counter
        for priority in sorted(tiers):
            queues = tiers[priority]
            while queues:
                tenant = min(queues, key=lambda t: (counter(priority, t), queues[t][0].arrival_order))
                queue = queues[tenant]
                yield queue.popleft()
                if not queue:
                    del queues[tenant]

    @staticmethod
    def running_key(request: Request) -> Any:
        return request.group.priority, request.arrival_order

    def may_displace(self, candidate: Request, running: Request) -> bool:
        return running.group.priority > candidate.group.priority

    def prefill_chunk_limit(self, request: Request) -> int | None:
        if self.lower_tier_prefill_chunk is None:
            return None
        priority, horizon = request.group.priority, time.monotonic() - self.active_window_s
        if any(p < priority and seen >= horizon for p, seen in self._last_arrival.items()):
            return self.lower_tier_prefill_chunk
        return None

    def on_add(self, request: Request) -> None:
        group = request.group
        self._last_arrival[group.priority] = time.monotonic()
        self.counters.join(group.priority, group.tenant, group.tenant_weight)

    def on_admit(self, request: Request, num_prompt_tokens: int) -> None:
        if request.seq_id in self._prompt_charged:
            return
        self._prompt_charged.add(request.seq_id)
        group = request.group
        self.counters.charge_prompt(group.priority, group.tenant, num_prompt_tokens)

    def on_output(self, request: Request, num_tokens: int) -> None:
        group = request.group
        self.counters.charge_output(group.priority, group.tenant, num_tokens)

    def on_leave(self, request: Request) -> None:
        self._prompt_charged.discard(request.seq_id)
        group = request.group
        self.counters.leave(group.priority, group.tenant)


def make_policy(name: str, device_type: str = "cpu", *, lower_tier_prefill_chunk: int | None = None) -> FcfsPolicy:
    """The policy `name`. `lower_tier_prefill_chunk` None picks by device: a CPU step's time grows
    with every prompt token it holds (about 2 ms each for the 125M reference model on one thread),
    so 16 keeps a step holding worse-tier prefill near a decode step; a GPU computes a few hundred
    tokens in about the time of one, so there it stays off. 0 turns it off."""
    if name == "fcfs":
        return FcfsPolicy()
    if name == "priority":
        if lower_tier_prefill_chunk is None:
            lower_tier_prefill_chunk = DEFAULT_CPU_LOWER_TIER_PREFILL_CHUNK if device_type == "cpu" else 0
        return PriorityFairPolicy(lower_tier_prefill_chunk=lower_tier_prefill_chunk or None)
    raise ValueError(f"scheduling policy {name!r} is not one of {', '.join(POLICIES)}")
