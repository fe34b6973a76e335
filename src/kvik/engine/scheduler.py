"""Continuous batching under a per-step token budget.

There is no prefill phase and no decode phase: every step hands each sequence up to
`num_tokens - num_computed_tokens` new tokens from a shared budget (`max_num_batched_tokens`), running
sequences first, then waiting ones in arrival order (FCFS) while `max_num_seqs` allows. A long prompt
takes what is left of the budget and continues next step (chunked prefill). When blocks run out, the
most recently arrived running sequence is preempted: its blocks are freed and it goes back to the
front of the waiting queue to be recomputed later (its sampled tokens are kept, so no token changes).

The queue policy is one method (`_admission_order`), kept separate so priorities can replace FCFS;
`ScheduledChunk` carries the token count per sequence, which is where speculative tokens and LoRA or
grammar state would ride along.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvik.engine.kv_manager import KVCacheManager
from kvik.engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    num_new_tokens: int
    start: int  # num_computed_tokens when scheduled: the first position computed in this step

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def completes_sequence(self) -> bool:
        """All known tokens are computed after this chunk: its last logits give the next token."""
        return self.end == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_new_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:  # admitting new work right after preempting would thrash
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is request:
                    return budget
            out.chunks.append(ScheduledChunk(request, num_new, request.num_computed_tokens))
            budget -= num_new
            index += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        for request in self._admission_order():
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                return
            leader = request.wait_for_prompt_of
            if leader is not None and not self._prompt_computed(leader):
                continue  # a sibling of an n>1 request: admitted once the prompt's blocks are cached
            request.wait_for_prompt_of = None
            hit = self.kv.find_cached_prefix(request) if request.num_computed_tokens == 0 else None
            hit_tokens = hit.num_blocks * self.kv.block_size if hit else 0
            num_new = request.num_tokens - request.num_computed_tokens - hit_tokens
            if num_new > budget and not self.enable_chunked_prefill:
                return
            num_new = min(num_new, budget)
            if not self.kv.allocate_slots(request, num_new, hit):
                return  # FCFS: nobody overtakes the head of the queue for blocks
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = hit_tokens
                self.kv.record_prefix_query(request.num_tokens, hit_tokens)
            request.num_computed_tokens += hit_tokens
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(ScheduledChunk(request, num_new, request.num_computed_tokens))
            budget -= num_new

    def _admission_order(self) -> list[Request]:
        """FCFS. Preempted sequences were put back at the front, in arrival order."""
        return list(self.waiting)

    @staticmethod
    def _prompt_computed(leader: Request) -> bool:
        return leader.status.finished or leader.num_computed_tokens >= leader.num_prompt_tokens

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        # Back to the waiting queue in arrival order among the other waiting sequences.
        position = 0
        while position < len(self.waiting) and self.waiting[position].arrival_order < request.arrival_order:
            position += 1
        self.waiting.insert(position, request)
        out.preempted.append(request)
        self.num_preemptions += 1

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a sequence (finished or aborted) and free its blocks at once."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.kv.free(request)
