"""Which LoRA adapters the engine knows, which sit in CPU memory, and which in the model's slots.

Three tiers, each an LRU:
- registered: name -> adapter directory, checked against the base model when added (`add`);
- CPU cache: up to `max_cpu_loras` adapters' weights in host memory (None: all registered ones);
  an adapter evicted from it is read from its directory again when next needed;
- slots: `max_loras` rows of the model's LoRA stacks (device memory). A sequence pins its adapter's
  slot from admission until it finishes or is preempted; the least recently used unpinned slot is
  refilled when a waiting sequence needs an adapter that is not in one. An adapter whose every slot
  candidate is pinned waits (the scheduler admits other sequences meanwhile).

Every registration gets a fresh `lora_id`, never reused: it is mixed into the prefix-cache hash, so
two adapters (or an adapter and the same name re-registered from another directory) never share KV
blocks.
"""

from __future__ import annotations

import itertools
import logging
import re
import time
from collections import OrderedDict
from dataclasses import dataclass

from kvik.core.errors import ConflictError, InvalidRequestError, KvikError, NotFoundError
from kvik.engine.messages import LoRAAdapterInfo
from kvik.model.lora import LoRAAdapterWeights, LoRAModel, read_peft_adapter

logger = logging.getLogger("kvik.engine")

# Adapter names travel in `model` fields and URLs: printable, no spaces, bounded.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


@dataclass(slots=True)
class AdapterEntry:
    name: str
    lora_id: int
    path: str
    rank: int
    target_modules: list[str]
    created: int
    slot: int = -1  # row of the model's LoRA stacks, -1 when in none
    pins: int = 0  # running sequences using the slot


@dataclass(slots=True)
class AdapterCounters:
    slot_loads: int = 0  # adapters copied into a slot
    cpu_hits: int = 0  # of those, from the CPU cache
    disk_loads: int = 0  # read from the adapter directory again (evicted from the CPU cache)
    slot_evictions: int = 0


class AdapterManager:
    def __init__(self, model: LoRAModel, max_cpu_loras: int | None = None) -> None:
        self.model = model
        self.max_cpu_loras = max_cpu_loras
        self.adapters: dict[str, AdapterEntry] = {}
        self.by_id: dict[int, AdapterEntry] = {}
        self.cpu_cache: OrderedDict[int, LoRAAdapterWeights] = OrderedDict()
        self.slot_owner: list[int] = [0] * model.max_loras  # lora_id per slot, 0 = empty
        self.slot_order: OrderedDict[int, None] = OrderedDict((s, None) for s in range(model.max_loras))
        self.counters = AdapterCounters()
        self._ids = itertools.count(1)

    # -- registration (utility calls from the front end) --

    def add(self, name: str, path: str) -> LoRAAdapterInfo:
        """Register an adapter after reading and checking it; raises a KvikError naming the problem."""
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise InvalidRequestError(f"lora_name: {name!r} is not a valid adapter name (1-128 letters, digits "
                                      "and ._:/@+-, starting with a letter or digit)", param="lora_name")
        if name in self.adapters:
            raise ConflictError(f"lora_name: an adapter named {name!r} is already loaded; unload it first",
                                param="lora_name")
        if not isinstance(path, str) or not path:
            raise InvalidRequestError("lora_path: give the adapter's directory on the server", param="lora_path")
        weights = read_peft_adapter(path)
        self.model.check(weights)
        entry = AdapterEntry(name, next(self._ids), weights.path, weights.rank, weights.target_modules,
                             int(time.time()))
        self.adapters[name] = entry
        self.by_id[entry.lora_id] = entry
        self._cache(entry.lora_id, weights)
        logger.info("LoRA adapter %s (id %d, rank %d, %s) from %s", name, entry.lora_id, entry.rank,
                    ", ".join(entry.target_modules), entry.path)
        return self.info(entry)

    def remove(self, name: str, in_use: bool) -> None:
        """Forget an adapter; refused while requests (`in_use`: waiting or running) reference it."""
        entry = self.entry(name)
        if in_use or entry.pins:
            raise ConflictError(f"lora_name: adapter {name!r} is in use by requests; unload it once they finish",
                                param="lora_name")
        if entry.slot >= 0:
            self.model.clear(entry.slot)
            self.slot_owner[entry.slot] = 0
            self.slot_order.move_to_end(entry.slot, last=False)  # empty: the first to fill
        self.cpu_cache.pop(entry.lora_id, None)
        del self.adapters[name]
        del self.by_id[entry.lora_id]
        logger.info("LoRA adapter %s unloaded", name)

    def entry(self, name: str) -> AdapterEntry:
        entry = self.adapters.get(name)
        if entry is None:
            raise NotFoundError(f"lora_name: no adapter named {name!r} is loaded", param="lora_name")
        return entry

    def list(self) -> list[LoRAAdapterInfo]:
        return [self.info(entry) for entry in self.adapters.values()]

    @staticmethod
    def info(entry: AdapterEntry) -> LoRAAdapterInfo:
        return LoRAAdapterInfo(entry.name, entry.lora_id, entry.path, entry.rank, list(entry.target_modules),
                               entry.created)

    # -- slots (the scheduler, at admission and when a sequence leaves the running batch) --

    def can_acquire(self, lora_id: int) -> bool:
        entry = self.by_id[lora_id]
        return entry.slot >= 0 or any(self._evictable(slot) for slot in self.slot_order)

    def acquire(self, lora_id: int) -> int:
        """Pin the adapter's slot for one running sequence, filling a slot first if needed (call
        can_acquire before). Raises KvikError when the adapter's directory can no longer be read."""
        entry = self.by_id[lora_id]
        if entry.slot < 0:
            # An empty slot if there is one, else the least recently used one nobody runs on.
            slot = next((s for s in self.slot_order if not self.slot_owner[s]), None)
            if slot is None:
                slot = next(s for s in self.slot_order if self._evictable(s))
            weights = self._weights(entry)
            previous = self.by_id.get(self.slot_owner[slot])
            if previous is not None:
                previous.slot = -1
                self.counters.slot_evictions += 1
            self.model.load(slot, weights)
            self.slot_owner[slot] = lora_id
            entry.slot = slot
            self.counters.slot_loads += 1
        entry.pins += 1
        self.slot_order.move_to_end(entry.slot)
        return entry.slot

    def release(self, lora_id: int) -> None:
        entry = self.by_id.get(lora_id)
        if entry is not None and entry.pins > 0:
            entry.pins -= 1

    def _evictable(self, slot: int) -> bool:
        owner = self.by_id.get(self.slot_owner[slot])
        return owner is None or owner.pins == 0

    def _weights(self, entry: AdapterEntry) -> LoRAAdapterWeights:
        weights = self.cpu_cache.get(entry.lora_id)
        if weights is not None:
            self.cpu_cache.move_to_end(entry.lora_id)
            self.counters.cpu_hits += 1
            return weights
        try:
            weights = read_peft_adapter(entry.path)
            self.model.check(weights)
        except KvikError as exc:
            raise KvikError(f"LoRA adapter {entry.name!r} could not be reloaded from {entry.path}: {exc.message}") \
                from None
        self.counters.disk_loads += 1
        self._cache(entry.lora_id, weights)
        return weights

    def _cache(self, lora_id: int, weights: LoRAAdapterWeights) -> None:
        self.cpu_cache[lora_id] = weights
        self.cpu_cache.move_to_end(lora_id)
        while self.max_cpu_loras is not None and len(self.cpu_cache) > self.max_cpu_loras:
            self.cpu_cache.popitem(last=False)
