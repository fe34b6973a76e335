"""Scheduler: token budget, FCFS admission, chunked prefill, preemption order."""

from __future__ import annotations

from kvik.engine.kv_manager import KVCacheManager
from kvik.engine.request import RequestStatus
from kvik.engine.scheduler import Scheduler
from tests.engine.helpers import make_request


def run_step(scheduler: Scheduler, out) -> None:
    """Apply a step's results the way the engine does: advance, then append a token to
    sequences whose known tokens are all computed."""
    for chunk in out.chunks:
        chunk.request.num_computed_tokens = chunk.end
        scheduler.kv.cache_computed_blocks(chunk.request)
        if chunk.request.num_computed_tokens == chunk.request.num_tokens:
            chunk.request.all_token_ids.append(1)


def test_budget_splits_long_prompt_across_steps_and_mixes_decodes():
    scheduler = Scheduler(KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    short, long = make_request([1, 2, 3]), make_request(list(range(25)))
    scheduler.add(short)
    scheduler.add(long)
    first = scheduler.schedule()
    assert [(c.request, c.num_new_tokens) for c in first.chunks] == [(short, 3), (long, 7)]
    run_step(scheduler, first)
    second = scheduler.schedule()
    # The short one decodes (1 token) while the long prompt continues with the rest of the budget.
    assert [(c.request, c.num_new_tokens, c.start) for c in second.chunks] == [(short, 1, 3), (long, 9, 7)]


def test_max_num_seqs_limits_admission():
    scheduler = Scheduler(KVCacheManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    requests = [make_request([1, 2]) for _ in range(3)]
    for request in requests:
        scheduler.add(request)
    out = scheduler.schedule()
    assert [c.request for c in out.chunks] == requests[:2]
    assert list(scheduler.waiting) == requests[2:]


def test_fcfs_head_blocks_later_requests_when_blocks_are_short():
    scheduler = Scheduler(KVCacheManager(4, 4), max_num_seqs=8, max_num_batched_tokens=100)
    big, small = make_request(list(range(20))), make_request([1])
    scheduler.add(big)
    scheduler.add(small)
    assert scheduler.schedule().is_empty  # big needs 5 blocks; small may not overtake it


def test_preemption_frees_the_newest_and_requeues_it_first():
    kv = KVCacheManager(4, 2)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    old, new = make_request([1, 2, 3, 4]), make_request([5, 6, 7, 8])
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler, scheduler.schedule())  # 2 blocks each: pool full
    out = scheduler.schedule()  # old needs a 3rd block for position 4 -> new is preempted
    assert out.preempted == [new]
    assert [c.request for c in out.chunks] == [old]
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert list(scheduler.waiting) == [new]
    assert kv.block_ids(new) == []
    kv.pool.check_invariants()


def test_finish_frees_blocks_at_once():
    kv = KVCacheManager(8, 4)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    request = make_request(list(range(9)))
    scheduler.add(request)
    scheduler.schedule()
    scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks() == 8 and not scheduler.running


def test_first_scheduled_time_is_when_the_step_is_planned_and_the_prefix_hit_with_it():
    """Queue time ends when a step first carries the request, not when that step has run (the
    step is the request's prefill); a later step or a preemption does not move it."""
    scheduler = Scheduler(KVCacheManager(64, 4), max_num_seqs=1, max_num_batched_tokens=100)
    first, second = make_request([1, 2, 3]), make_request([4, 5])
    scheduler.add(first)
    scheduler.add(second)
    out = scheduler.schedule()
    planned = first.group.first_scheduled_time
    assert planned is not None and second.group.first_scheduled_time is None  # max_num_seqs 1: it waits
    assert first.group.num_cached_tokens == 0
    run_step(scheduler, out)
    run_step(scheduler, scheduler.schedule())
    assert first.group.first_scheduled_time == planned
