"""Scheduler with pooling requests: whole prompts under the budget for an encoder (no KV blocks),
chunked last-token pooling on a decoder, and pooled outputs ending requests."""

from __future__ import annotations

from kvik.core.pooling_params import PoolingParams
from kvik.engine.kv_manager import KVCacheManager
from kvik.engine.request import RequestStatus
from kvik.engine.scheduler import Scheduler
from tests.engine.helpers import make_request

VECTOR = b"\x00\x00\x80?"  # float32 1.0


def pooling_request(prompt: list[int], whole: bool):
    request = make_request(prompt)
    request.pooling, request.needs_whole_prompt = PoolingParams(), whole
    return request


def test_encoder_prompts_run_whole_without_blocks():
    scheduler = Scheduler(KVCacheManager(0, 16), max_num_seqs=8, max_num_batched_tokens=32,
                          uses_kv_cache=False)
    first, second, small = (pooling_request(list(range(20)), True), pooling_request(list(range(20)), True),
                            pooling_request([5, 6], True))
    for request in (first, second, small):
        scheduler.add(request)
    out = scheduler.schedule()
    # 12 tokens of budget are left after the first prompt: the second waits whole (and, FCFS, so
    # does the small one behind it) instead of being chunked.
    assert [(c.request, c.num_new_tokens, c.block_ids) for c in out.chunks] == [(first, 20, [])]
    outputs = scheduler.update_from_output(out, {}, {first: VECTOR})
    assert [(o.request_id, o.pooled, o.finish_reason, o.new_token_ids) for o in outputs] == \
        [(first.group.request_id, VECTOR, "stop", [])]
    assert first.status is RequestStatus.FINISHED_STOPPED and not scheduler.running
    out = scheduler.schedule()
    assert [(c.request, c.num_new_tokens) for c in out.chunks] == [(second, 20), (small, 2)]


def test_decoder_last_token_pooling_is_chunked_and_ends_with_the_prompt():
    kv = KVCacheManager(16, 4)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=8)
    request = pooling_request(list(range(10)), False)
    scheduler.add(request)
    first = scheduler.schedule()
    assert [c.num_new_tokens for c in first.chunks] == [8]
    assert scheduler.update_from_output(first, {}, {}) == []  # not done: nothing to report
    second = scheduler.schedule()
    assert [(c.start, c.num_new_tokens, c.completes_sequence) for c in second.chunks] == [(8, 2, True)]
    outputs = scheduler.update_from_output(second, {}, {request: VECTOR})
    assert outputs[0].pooled == VECTOR and request.num_output_tokens == 0
    assert kv.num_free_blocks() == 16  # its blocks went back (cached, evictable)
