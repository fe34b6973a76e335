"""AdapterManager's slot LRU and CPU cache, on a stub of the model's LoRA slots."""

from __future__ import annotations

import pytest

from kvik.core.errors import ConflictError
from kvik.engine.lora_manager import AdapterManager


class StubSlots:
    """What AdapterManager needs of kvik.model.lora.LoRAModel: slots to fill and clear."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.contents: dict[int, str] = {}

    def check(self, weights) -> None:
        pass

    def load(self, slot: int, weights) -> None:
        self.contents[slot] = weights.path

    def clear(self, slot: int) -> None:
        self.contents.pop(slot, None)


@pytest.fixture
def manager(trained_adapters) -> AdapterManager:
    manager = AdapterManager(StubSlots(2), max_cpu_loras=2)
    for name in ("ad0", "ad1", "ad2"):
        manager.add(name, str(trained_adapters[name]))
    return manager


def ids(manager: AdapterManager, *names: str) -> list[int]:
    return [manager.entry(name).lora_id for name in names]


def test_least_recently_used_idle_slot_is_refilled_and_pinned_slots_never(manager) -> None:
    a0, a1, a2 = ids(manager, "ad0", "ad1", "ad2")
    first, second = manager.acquire(a0), manager.acquire(a1)
    assert first != second
    assert not manager.can_acquire(a2)  # both slots pinned by running sequences
    manager.release(a1)
    assert manager.can_acquire(a2) and manager.acquire(a2) == second  # ad1's slot, ad0 is pinned
    assert manager.entry("ad1").slot == -1 and manager.counters.slot_evictions == 1
    manager.release(a0)
    manager.release(a2)
    manager.acquire(a2)  # a2 is now the most recently used
    manager.release(a2)
    assert manager.acquire(a1) == first  # so ad0's slot goes


def test_cpu_cache_is_bounded_and_unloading_frees_the_slot_first(manager) -> None:
    assert len(manager.cpu_cache) == 2  # ad0 was pushed out by ad1 and ad2
    a0, a1, a2 = ids(manager, "ad0", "ad1", "ad2")
    manager.acquire(a0)
    assert manager.counters.disk_loads == 1
    manager.acquire(a1)
    manager.release(a1)
    manager.remove("ad1", in_use=False)
    assert manager.acquire(a2) == 1 - manager.entry("ad0").slot  # the emptied slot, ad0 untouched
    assert manager.entry("ad0").slot >= 0
    with pytest.raises(ConflictError, match="in use"):
        manager.remove("ad0", in_use=False)  # pinned
