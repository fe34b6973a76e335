"""Continuous batching under a per-step token budget.

There is no prefill phase and no decode phase: every step hands each sequence up to
`num_tokens - num_computed_tokens` new tokens from a shared budget (`max_num_batched_tokens`), running
sequences first, then waiting ones in the policy's order while `max_num_seqs` allows. A long prompt
takes what is left of the budget and continues next step (chunked prefill). When blocks run out, the
last running sequence in the policy's order is preempted: its blocks are freed and it goes back to
the waiting queue at its arrival position to be recomputed later (its sampled tokens are kept, so no
token changes). A sequence displaced only for a batch slot by a better-ranked one is suspended
instead: out of the batch with its blocks kept, it resumes where it stopped; suspended sequences
give their blocks up (and become preempted) before anyone running is preempted for blocks.

The queue policy (`kvik.engine.scheduling_policy`: FCFS, or priority tiers with fair share between
tenants) decides the admission order, the preemption order, and whether a waiting sequence may
displace a running one (preempt it for a slot or blocks, or defer its chunk for budget), and how
many prompt tokens a sequence may compute in one step; the scheduler only asks it at those points
and reports tokens served to it. `ScheduledChunk` carries the token count and the block ids per
sequence, so the model runner never reads the KV manager.

Speculative decoding adds draft tokens to a running sequence (`Request.spec_token_ids`, proposed by
`kvik.engine.spec_decode` after the previous step): they are scheduled after the known tokens and
counted in the budget like any other token (drafts that do not fit are dropped, never the known
tokens), and blocks are allocated for them; when blocks run short the drafts go before anyone is
preempted.

Multi-step decoding (`num_scheduler_steps` > 1, `kvik.engine.multi_step`): a step of plain decode
tokens while nobody waits may run several forwards back to back (`SchedulerOutput.num_steps`); their
tokens come back as one list per sequence, as after a verification.

After the model ran, `update_from_output` owns the bookkeeping: it appends the sampled tokens (one,
or for a verified chunk the accepted drafts plus one), applies the token-level stop conditions after
each, moves `num_computed_tokens` to the tokens whose KV is now valid (rolling back over rejected
drafts: their slots are overwritten later, their blocks stay in the table for reuse), registers
newly full blocks of accepted tokens in the prefix cache, and returns one `EngineCoreOutput` per
sequence that produced something.

Pooling requests (embeddings, classification) ride the same queue and budget. They end in the step
that computes their last prompt token, with the pooled vector instead of a sampled token. One that
`needs_whole_prompt` (an encoder's, or mean/CLS pooling) is admitted only when its whole prompt fits
the step's remaining budget, and never reads the prefix cache. An encoder model has no KV cache at
all (`uses_kv_cache=False`): nothing is allocated for its requests.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvik.core.errors import KvikError
from kvik.engine.kv_manager import KVCacheManager
from kvik.engine.messages import EngineCoreOutput, TokenLogprobs
from kvik.engine.multi_step import MultiStepPlanner
from kvik.engine.request import Request, RequestStatus, check_stop
from kvik.engine.scheduling_policy import FcfsPolicy


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    num_new_tokens: int  # known tokens to compute plus draft tokens
    start: int  # num_computed_tokens when scheduled: the first position computed in this step
    block_ids: list[int] = field(default_factory=list)  # the sequence's block table this step
    # Draft tokens computed after the known ones (positions num_tokens, num_tokens + 1, ...): the
    # chunk's logits at the last known token and at each draft verify them.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def completes_sequence(self) -> bool:
        """All known tokens (and the drafts) are computed after this chunk: its logits from the last
        known token on give the next token(s)."""
        return self.end == self.request.num_tokens + len(self.spec_token_ids)

    def token_at(self, position: int) -> int:
        """The token computed at `position`: a known one, or a draft past the known tokens."""
        tokens = self.request.all_token_ids
        return tokens[position] if position < len(tokens) else self.spec_token_ids[position - len(tokens)]


@dataclass(slots=True)
class SampledTokens:
    """What a step produced for one sequence whose known tokens were all computed: one token, or
    after verifying drafts the accepted ones plus the token sampled after them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # one entry per token, when asked for


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Forwards to run back to back (multi-step decoding): every chunk is one decode token, blocks
    # are allocated for all of them, each after the first computes the token the one before sampled.
    num_steps: int = 1

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, *, eos_token_ids: frozenset[int] = frozenset(),
                 max_model_len: int = 2**31, uses_kv_cache: bool = True,
                 policy: FcfsPolicy | None = None, adapters: Any = None, num_scheduler_steps: int = 1) -> None:
        self.kv = kv
        self.multi_step = MultiStepPlanner(num_scheduler_steps)
        # LoRA slots (kvik.engine.lora_manager.AdapterManager), when adapters are served: a sequence
        # pins its adapter's slot from admission until it leaves the running batch.
        self.adapters = adapters
        self.failed: list[EngineCoreOutput] = []  # sequences ended at admission, for the core to report
        self.uses_kv_cache = uses_kv_cache
        self.policy = policy or FcfsPolicy()
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_preemptions_by_priority: Counter[int] = Counter()
        self.num_suspensions = 0  # displaced for a batch slot, KV kept (not counted as preemptions)

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self.policy.on_add(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:  # admitting new work right after preempting would thrash
            self._schedule_waiting(out, budget)
        if self.multi_step.num_scheduler_steps > 1 and not self.waiting and not out.preempted:
            out.num_steps = self.multi_step.plan(out.chunks, self.kv, self.max_model_len)
        # Stamped when the step is planned, not when it ends: queue time is the wait for a step,
        # and the step itself is the request's prefill (the front end's `queue`/`prefill` spans).
        now = time.time()
        for chunk in out.chunks:
            group = chunk.request.group
            if group.first_scheduled_time is None:
                group.first_scheduled_time = now
                group.num_cached_tokens = max(chunk.request.num_cached_tokens, 0)
        return out

    def observe_step(self, seconds: float, forwards: int) -> None:
        """How long the last step took and how many forwards it ran (the core reports each step)."""
        self.multi_step.observe(seconds, forwards)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        self.running.sort(key=self.policy.running_key)  # the last is the first to give way
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_known = request.num_tokens - request.num_computed_tokens
            num_new = min(num_known + len(request.spec_token_ids), budget)
            if num_known > 1:  # a prefill going on (drafts only ride on a single known token)
                num_new = min(num_new, self.policy.prefill_chunk_limit(request) or num_new)
            del request.spec_token_ids[max(0, num_new - num_known):]  # drafts past the budget
            while self.uses_kv_cache and not self.kv.allocate_slots(request, num_new):
                if request.spec_token_ids:  # drafts give way before anyone is preempted
                    num_new -= len(request.spec_token_ids)
                    request.spec_token_ids.clear()
                    continue
                if self._release_suspended(out):
                    continue
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is request:
                    return budget
            out.chunks.append(ScheduledChunk(request, num_new, request.num_computed_tokens,
                                             self.kv.block_ids(request), list(request.spec_token_ids)))
            budget -= num_new
            index += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        for request in self._admission_order():
            leader = request.wait_for_prompt_of
            if leader is not None and not self._prompt_computed(leader):
                continue  # a sibling of an n>1 request: admitted once the prompt's blocks are cached
            request.wait_for_prompt_of = None
            lora_id = request.group.lora_id
            if lora_id and not self.adapters.can_acquire(lora_id):
                continue  # every slot holds an adapter running sequences use; others may go first
            whole = request.needs_whole_prompt
            hit = (self.kv.find_cached_prefix(request)
                   if request.num_computed_tokens == 0 and not whole and self.uses_kv_cache else None)
            hit_tokens = hit.num_blocks * self.kv.block_size if hit else 0
            num_wanted = request.num_tokens - request.num_computed_tokens - hit_tokens
            if not whole and self.enable_chunked_prefill and num_wanted > 1:
                num_wanted = min(num_wanted, self.policy.prefill_chunk_limit(request) or num_wanted)
            room = self._make_room(request, out, budget, num_wanted, chunkable=not whole)
            if room is None:
                return  # nobody overtakes the head of the queue
            budget = room
            num_new = min(num_wanted, budget)
            while self.uses_kv_cache and not self.kv.allocate_slots(request, num_new, hit):
                if self._release_suspended(out, keep=request):
                    continue
                freed = self._preempt_for(request, out)
                if freed is None:
                    return  # nobody overtakes the head of the queue for blocks
                budget += freed
            if lora_id and not self._pin_adapter(request):
                continue
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = hit_tokens
                if self.uses_kv_cache:
                    self.kv.record_prefix_query(request.num_tokens, hit_tokens)
            self.policy.on_admit(request, max(0, request.num_prompt_tokens - hit_tokens))
            request.num_computed_tokens += hit_tokens
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(ScheduledChunk(request, num_new, request.num_computed_tokens,
                                             self.kv.block_ids(request)))
            budget -= num_new

    def _pin_adapter(self, request: Request) -> bool:
        """Give an admitted sequence its adapter's slot; if the adapter can no longer be loaded (its
        directory changed since it was registered), the sequence fails alone."""
        try:
            request.lora_slot = self.adapters.acquire(request.group.lora_id)
            return True
        except KvikError as exc:
            request.finish_reason = RequestStatus.FINISHED_ERROR.value
            self.finish(request, RequestStatus.FINISHED_ERROR)
            output = self._output(request, [], None, None)
            output.error = exc.message
            self.failed.append(output)
            return False

    def take_failed(self) -> list[EngineCoreOutput]:
        failed, self.failed = self.failed, []
        return failed

    def _release_adapter(self, request: Request) -> None:
        if request.lora_slot >= 0:
            self.adapters.release(request.group.lora_id)
            request.lora_slot = -1

    def _admission_order(self) -> Iterator[Request]:
        """The policy's order; lazily, since admitting one request may change who is next."""
        return self.policy.admission_order(self.waiting)

    # -- displacement: a waiting sequence taking the place of running ones the policy ranks lower --

    def _make_room(self, request: Request, out: SchedulerOutput, budget: int, num_wanted: int, *,
                   chunkable: bool = True) -> int | None:
        """A batch slot and token budget for `request`, displacing what the policy allows; the
        budget it may use, or None if it cannot be admitted this step. A request that is not
        `chunkable` (a pooling request that needs its whole prompt at once) needs all of it."""
        while len(self.running) >= self.max_num_seqs:
            freed = self._preempt_for(request, out, keep_blocks=True)
            if freed is None:
                return None
            budget += freed
        if budget < num_wanted:
            budget += self._defer_for(request, out, num_wanted - budget)
        if budget <= 0 or (num_wanted > budget and not (chunkable and self.enable_chunked_prefill)):
            return None
        return budget

    def _preempt_for(self, request: Request, out: SchedulerOutput, *, keep_blocks: bool = False) -> int | None:
        """Preempt the running sequence the policy ranks last, if `request` may displace it; the
        budget its chunk held this step, or None when nothing may be displaced. `keep_blocks`
        (displaced for a batch slot, not for memory): the victim keeps its KV and resumes where it
        stopped, instead of recomputing its last partial block (or more, with its blocks evicted);
        that recompute would make a later step long, and the next arrival of the tier that
        displaced it would wait for that step."""
        if not self.running:
            return None
        victim = max(self.running, key=self.policy.running_key)
        if not self.policy.may_displace(request, victim):
            return None
        freed = self._unschedule(victim, out)
        if keep_blocks and victim.num_computed_tokens > 0 and self.uses_kv_cache:
            self._suspend(victim)
        else:
            self._preempt(victim, out)
        return freed

    def _defer_for(self, request: Request, out: SchedulerOutput, needed: int) -> int:
        """Push chunks of running sequences `request` may displace to the next step (they keep their
        blocks), lowest ranked first, until `needed` tokens of budget are free; the budget freed."""
        freed = 0
        for chunk in sorted(out.chunks, key=lambda c: self.policy.running_key(c.request), reverse=True):
            if freed >= needed or not self.policy.may_displace(request, chunk.request):
                break
            freed += self._unschedule(chunk.request, out)
        return freed

    @staticmethod
    def _unschedule(request: Request, out: SchedulerOutput) -> int:
        for position, chunk in enumerate(out.chunks):
            if chunk.request is request:
                del out.chunks[position]
                return chunk.num_new_tokens
        return 0

    @staticmethod
    def _prompt_computed(leader: Request) -> bool:
        return leader.status.finished or leader.num_computed_tokens >= leader.num_prompt_tokens

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._requeue(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        out.preempted.append(request)
        self.num_preemptions += 1
        self.num_preemptions_by_priority[request.group.priority] += 1

    def _suspend(self, request: Request) -> None:
        """Out of the batch, blocks kept: waiting again with its computed tokens (SUSPENDED)."""
        self.running.remove(request)
        self._requeue(request)
        request.status = RequestStatus.SUSPENDED
        self.num_suspensions += 1
        self.num_preemptions_by_priority[request.group.priority] += 1  # displaced all the same

    def _requeue(self, request: Request) -> None:
        self._release_adapter(request)
        request.spec_token_ids.clear()
        # Back to the waiting queue in arrival order among the other waiting sequences.
        position = 0
        while position < len(self.waiting) and self.waiting[position].arrival_order < request.arrival_order:
            position += 1
        self.waiting.insert(position, request)

    def _release_suspended(self, out: SchedulerOutput, keep: Request | None = None) -> bool:
        """Free the blocks of the suspended sequence the policy ranks last (it will recompute, as a
        preempted one does): blocks held for a later resume give way before anyone running is
        preempted. False when no suspended sequence holds blocks."""
        suspended = [r for r in self.waiting if r.status is RequestStatus.SUSPENDED and r is not keep]
        if not suspended:
            return False
        self._preempt(max(suspended, key=self.policy.running_key), out)
        return True

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a sequence (finished or aborted) and free its blocks at once."""
        if not request.status.finished:
            self.policy.on_leave(request)
        request.status = status
        self._release_adapter(request)
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.kv.free(request)

    # -- after the step --

    def update_from_output(self, out: SchedulerOutput, sampled: dict[Request, SampledTokens],
                           pooled: dict[Request, bytes] | None = None) -> list[EngineCoreOutput]:
        """Apply one executed step: `sampled` maps each sequence whose known tokens were all
        computed to its new token(s) (and logprobs), `pooled` each pooling request whose prompt is
        now computed to its vector (float32 bytes). Returns what each sequence produced."""
        outputs: list[EngineCoreOutput] = []
        for chunk in out.chunks:
            request = chunk.request
            request.spec_token_ids.clear()  # verified in this step (or dropped by a preemption)
            if request.status.finished:  # aborted while the step ran (cannot happen in-process)
                request.num_computed_tokens = chunk.end
                continue
            if request.pooling is not None:
                request.num_computed_tokens = chunk.end
                self.kv.cache_computed_blocks(request)
                vector = pooled.get(request) if pooled else None
                if vector is not None:
                    request.finish_reason = RequestStatus.FINISHED_STOPPED.value
                    self.finish(request, RequestStatus.FINISHED_STOPPED)
                    output = self._output(request, [], None, None)
                    output.pooled = vector
                    outputs.append(output)
                continue
            result = sampled.get(request)
            if result is None:
                request.num_computed_tokens = chunk.end
                self.kv.cache_computed_blocks(request)
                prompt_logprobs = self._take_prompt_logprobs(request)
                if prompt_logprobs is not None:
                    outputs.append(self._output(request, [], None, prompt_logprobs))
                continue
            num_known = request.num_tokens
            stop = None
            taken = 0
            for token_id in result.token_ids:
                request.all_token_ids.append(token_id)
                taken += 1
                stop = check_stop(request, token_id, self.eos_token_ids, self.max_model_len)
                if stop is not None:
                    break  # tokens after a stop are dropped
            self.policy.on_output(request, taken)
            # Valid KV now: the known tokens and the accepted drafts among the new ones; the last
            # new token is computed next step. Rejected drafts' slots are overwritten then.
            request.num_computed_tokens = num_known + taken - 1
            self.kv.cache_computed_blocks(request)
            prompt_logprobs = self._take_prompt_logprobs(request)
            if stop is not None:
                status, request.stop_reason = stop
                request.finish_reason = status.value
                self.finish(request, status)
            logprobs = result.logprobs[:taken] if result.logprobs else None
            outputs.append(self._output(request, result.token_ids[:taken], logprobs, prompt_logprobs))
        return outputs

    @staticmethod
    def _take_prompt_logprobs(request: Request) -> list[TokenLogprobs | None] | None:
        """The group's prompt logprobs once every prompt position is scored, exactly once."""
        group = request.group
        entries = group.prompt_logprobs
        if (entries is None or group.prompt_logprobs_sent or not request.wants_prompt_logprobs
                or len(entries) < len(group.prompt_token_ids)):
            return None
        group.prompt_logprobs_sent = True
        return entries

    @staticmethod
    def _output(request: Request, new_tokens: list[int], logprobs: list[TokenLogprobs] | None,
                prompt_logprobs: list[TokenLogprobs | None] | None) -> EngineCoreOutput:
        group = request.group
        return EngineCoreOutput(
            request_id=group.request_id, index=request.index, new_token_ids=new_tokens,
            new_logprobs=logprobs, finish_reason=request.finish_reason if request.status.finished else None,
            stop_reason=request.stop_reason, num_cached_tokens=group.num_cached_tokens,
            first_scheduled_time=group.first_scheduled_time, prompt_logprobs=prompt_logprobs)
