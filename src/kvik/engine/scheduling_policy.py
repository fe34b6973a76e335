"""Who is admitted first and who gives way: the scheduler's queue policy, one class per policy.

The scheduler (`kvik.engine.scheduler`) owns the mechanics (token budget, blocks, preemption); a
policy answers four questions at its decision points:

- `admission_order`: in which order waiting sequences are offered a place in the batch;
- `running_key`: the order of the running batch, whose last member is preempted first when blocks
  run out;
- `may_displace`: whether a waiting sequence may take the place of a running one (preempt it for a
  batch slot or blocks, or push its chunk to the next step for token budget);
- accounting hooks (`on_add`, `on_admit`, `on_output`, `on_leave`) for policies that keep state.

`fcfs`: arrival order; the newest running sequence is preempted first; nobody displaces anybody.

`priority` (the default): vLLM's `priority` (lower value first). Tiers are strict: a waiting
sequence of a better tier displaces running sequences of worse tiers (lowest priority first, then
newest), so a background tier only ever runs on capacity the others leave idle and never delays
their admission. Within a tier, tenants share by tokens served (virtual token counters,
`kvik.engine.fair_share`): the waiting sequence of the tenant with the smallest counter goes
first, each tenant's own sequences in arrival order. With every request at priority 0 and no
tenant it admits exactly as `fcfs`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

from kvik.engine.fair_share import VirtualTokenCounters
from kvik.engine.request import Request

POLICIES = ("fcfs", "priority")


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

    def __init__(self, counters: VirtualTokenCounters | None = None) -> None:
        self.counters = counters or VirtualTokenCounters()
        self._prompt_charged: set[str] = set()  # seq ids whose prompt was charged (once, not per recompute)

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

    def on_add(self, request: Request) -> None:
        group = request.group
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


def make_policy(name: str) -> FcfsPolicy:
    if name == "fcfs":
        return FcfsPolicy()
    if name == "priority":
        return PriorityFairPolicy()
    raise ValueError(f"scheduling policy {name!r} is not one of {', '.join(POLICIES)}")
