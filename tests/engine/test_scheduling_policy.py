"""Scheduling policies: priority tiers (admission, displacement, preemption order) and fair share
between tenants (virtual token counters), on the real scheduler and KV manager with a fake model:
time is the step count, every scheduled sequence whose tokens are all computed samples token 1."""

from __future__ import annotations

from collections import Counter

import pytest

from kvik.core.sampling_params import SamplingParams
from kvik.engine.fair_share import VirtualTokenCounters
from kvik.engine.kv_manager import KVCacheManager
from kvik.engine.request import Request, RequestStatus
from kvik.engine.scheduler import SampledTokens, Scheduler
from kvik.engine.scheduling_policy import FcfsPolicy, PriorityFairPolicy, make_policy
from tests.engine.helpers import make_request


_first_token = iter(range(1, 10**9, 1000))


def request(prompt_len: int = 4, *, priority: int = 0, tenant: str = "", weight: float = 1.0,
            max_tokens: int = 8) -> Request:
    """A request with a prompt of its own (no prefix-cache hits between requests)."""
    first = next(_first_token)
    made = make_request(list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    made.group.priority, made.group.tenant, made.group.tenant_weight = priority, tenant, weight
    return made


def step(scheduler: Scheduler) -> list:
    """One engine step with a fake model; returns the core outputs."""
    out = scheduler.schedule()
    sampled = {chunk.request: SampledTokens([1], None) for chunk in out.chunks if chunk.completes_sequence}
    return scheduler.update_from_output(out, sampled)


def priority_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                       budget: int = 100) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, block_size), max_num_seqs, budget, policy=PriorityFairPolicy())


# -- priority tiers --

def test_admits_better_tiers_first_and_fcfs_within_a_tier():
    scheduler = priority_scheduler(max_num_seqs=3)
    background, standard_old, interactive, standard_new = (
        request(priority=10), request(priority=0), request(priority=-10), request(priority=0))
    for made in (background, standard_old, interactive, standard_new):
        scheduler.add(made)
    admitted = [chunk.request for chunk in scheduler.schedule().chunks]
    assert admitted == [interactive, standard_old, standard_new]
    assert list(scheduler.waiting) == [background]


def test_a_better_tier_preempts_the_worst_running_sequence_for_a_batch_slot():
    scheduler = priority_scheduler(max_num_seqs=2)
    old_background, new_background = request(priority=10), request(priority=10)
    scheduler.add(old_background)
    scheduler.add(new_background)
    step(scheduler)
    interactive = request(priority=-10)
    scheduler.add(interactive)
    computed = new_background.num_computed_tokens
    blocks = scheduler.kv.block_ids(new_background)
    out = scheduler.schedule()
    # The worst tier, and within it the newest, leaves the batch; displaced for a slot, not for
    # memory, it keeps its KV (suspended, not preempted): nothing to recompute when it resumes.
    assert out.preempted == [] and scheduler.num_suspensions == 1
    assert interactive in [chunk.request for chunk in out.chunks]
    assert new_background not in [chunk.request for chunk in out.chunks]
    assert new_background.status is RequestStatus.SUSPENDED
    assert scheduler.kv.block_ids(new_background) == blocks and new_background.num_computed_tokens == computed
    assert list(scheduler.waiting) == [new_background]
    scheduler.kv.pool.check_invariants()


def test_a_suspended_sequence_resumes_where_it_stopped_with_the_same_tokens():
    """Once the better tier is done, the suspended sequence decodes on from its kept KV: one token
    scheduled (no prefill chunk), and its output is what it would have been."""
    scheduler = priority_scheduler(max_num_seqs=1)
    background = request(priority=10, max_tokens=6)
    scheduler.add(background)
    for _ in range(3):
        step(scheduler)
    computed = background.num_computed_tokens
    interactive = request(priority=-10, max_tokens=2)
    scheduler.add(interactive)
    while not interactive.status.finished:
        step(scheduler)
    assert background.status is RequestStatus.SUSPENDED
    out = scheduler.schedule()
    assert [(c.request, c.num_new_tokens, c.start) for c in out.chunks] == [(background, 1, computed)]
    scheduler.update_from_output(out, {background: SampledTokens([1], None)})
    while not background.status.finished:
        step(scheduler)
    assert background.output_token_ids == [1] * 6
    scheduler.kv.pool.check_invariants()
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.pool.num_blocks  # every block back


def test_suspended_sequences_give_their_blocks_up_before_anyone_running_is_preempted():
    scheduler = priority_scheduler(num_blocks=8, block_size=4, max_num_seqs=2)
    suspended = request(12, priority=10, max_tokens=20)  # 3 blocks, then 4 with its first tokens
    scheduler.add(suspended)
    step(scheduler)
    step(scheduler)
    interactive = [request(4, priority=-10, max_tokens=20) for _ in range(2)]
    for made in interactive:
        scheduler.add(made)
    step(scheduler)
    assert suspended.status is RequestStatus.SUSPENDED and scheduler.kv.block_ids(suspended)
    # The two interactive sequences grow until the pool is short: the suspended one's blocks go
    # first (it will recompute), and neither interactive sequence is preempted.
    for _ in range(12):
        step(scheduler)
    assert suspended.status is RequestStatus.PREEMPTED and scheduler.kv.block_ids(suspended) == []
    assert suspended.num_computed_tokens == 0
    assert all(r.status in (RequestStatus.RUNNING, RequestStatus.FINISHED_LENGTH) for r in interactive)
    assert scheduler.num_preemptions_by_priority[-10] == 0
    scheduler.kv.pool.check_invariants()


def test_a_better_tier_preempts_for_blocks_and_an_equal_tier_waits():
    scheduler = priority_scheduler(num_blocks=4, block_size=4)
    background = request(12, priority=10)  # 3 of the 4 blocks
    scheduler.add(background)
    step(scheduler)
    standard = request(12, priority=10)  # same tier: may not displace, waits at the head
    scheduler.add(standard)
    assert [c.request for c in scheduler.schedule().chunks] == [background]
    interactive = request(12, priority=0)
    scheduler.add(interactive)
    out = scheduler.schedule()
    assert out.preempted == [background]
    assert [c.request for c in out.chunks] == [interactive]
    scheduler.kv.pool.check_invariants()


def test_a_worse_tier_never_displaces_a_better_one():
    scheduler = priority_scheduler(max_num_seqs=1)
    interactive = request(priority=-10)
    scheduler.add(interactive)
    step(scheduler)
    scheduler.add(request(priority=10))
    out = scheduler.schedule()
    assert not out.preempted and [c.request for c in out.chunks] == [interactive]


def test_a_worse_tier_prefill_chunk_is_deferred_for_a_better_tier_within_the_step_budget():
    scheduler = priority_scheduler(budget=16)
    background = request(40, priority=10)
    scheduler.add(background)
    first = scheduler.schedule()
    assert [(c.request, c.num_new_tokens) for c in first.chunks] == [(background, 16)]
    step_outputs = scheduler.update_from_output(first, {})
    assert step_outputs == []
    interactive = request(12, priority=-10)
    scheduler.add(interactive)
    out = scheduler.schedule()
    # The interactive prompt gets its 12 tokens now; the background chunk waits (blocks kept).
    assert [(c.request, c.num_new_tokens) for c in out.chunks] == [(interactive, 12)]
    assert not out.preempted and background.status is RequestStatus.RUNNING
    assert background.num_computed_tokens == 16 and scheduler.kv.block_ids(background)


def test_blocks_running_out_preempt_the_worst_tier_then_the_newest():
    scheduler = priority_scheduler(num_blocks=6, block_size=2)
    interactive_new, background, interactive_old = request(4, priority=0), request(4, priority=5), request(4, priority=0)
    for made in (interactive_old, background, interactive_new):
        scheduler.add(made)
    step(scheduler)  # 2 blocks each: the pool is full, every sequence needs a third block
    out = scheduler.schedule()
    assert out.preempted[0] is background


def test_fcfs_ignores_priority_and_never_displaces():
    scheduler = Scheduler(KVCacheManager(64, 4), 1, 100, policy=FcfsPolicy())
    background = request(priority=10)
    scheduler.add(background)
    step(scheduler)
    scheduler.add(request(priority=-10))
    out = scheduler.schedule()
    assert not out.preempted and [c.request for c in out.chunks] == [background]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="fcfs, priority"):
        make_policy("lottery")


# -- fair share between tenants --

def simulate(policy, arrivals: dict[int, list[Request]], steps: int, *, max_num_seqs: int = 4,
             measure_from: int = 0) -> tuple[Counter, dict[str, list[int]]]:
    """Run `steps` steps, adding each step's arrivals first. Returns output tokens per tenant
    counted from `measure_from`, and each request's time to first token in steps, per tenant."""
    scheduler = Scheduler(KVCacheManager(4096, 4), max_num_seqs, 256, policy=policy)
    by_id: dict[str, Request] = {}
    arrived: dict[str, int] = {}
    served: Counter = Counter()
    ttft: dict[str, list[int]] = {}
    for now in range(steps):
        for made in arrivals.get(now, []):
            scheduler.add(made)
            by_id[made.group.request_id] = made
            arrived[made.group.request_id] = now
        for output in step(scheduler):
            made = by_id[output.request_id]
            if made.num_output_tokens == len(output.new_token_ids):
                ttft.setdefault(made.group.tenant, []).append(now - arrived[output.request_id])
            if now >= measure_from:
                served[made.group.tenant] += len(output.new_token_ids)
    return served, ttft


def periodic(tenant: str, every: float, steps: int, **kwargs) -> dict[int, list[Request]]:
    arrivals: dict[int, list[Request]] = {}
    position = 0.0
    while position < steps:
        arrivals.setdefault(int(position), []).append(request(8, tenant=tenant, max_tokens=16, **kwargs))
        position += every
    return arrivals


def merged(*parts: dict[int, list[Request]]) -> dict[int, list[Request]]:
    out: dict[int, list[Request]] = {}
    for part in parts:
        for when, made in part.items():
            out.setdefault(when, []).extend(made)
    return out


def test_tenant_at_ten_times_the_rate_does_not_take_the_other_tenants_share():
    # Capacity: 4 sequences x 1 token per step. B asks for 16 tokens every 6 steps (2.7 tokens per
    # step, more than half the capacity); A asks ten times that.
    steps = 900
    shares = {}
    for name, policy in (("fcfs", FcfsPolicy()), ("priority", PriorityFairPolicy())):
        workload = merged(periodic("A", 0.6, steps), periodic("B", 6, steps))
        served, _ = simulate(policy, workload, steps, measure_from=100)
        shares[name] = served["B"] / (served["A"] + served["B"])
    assert shares["priority"] >= 0.45, shares  # VTC: both backlogged -> half each
    assert shares["fcfs"] < 0.2, shares  # FCFS serves in proportion to requests sent


def test_tenant_weights_scale_the_share():
    steps = 500
    workload = merged(periodic("A", 1.0, steps, weight=2.0), periodic("B", 1.0, steps))
    served, _ = simulate(PriorityFairPolicy(), workload, steps, measure_from=100)
    assert served["A"] / served["B"] == pytest.approx(2.0, rel=0.15)


def test_a_better_tier_keeps_its_unloaded_ttft_while_a_worse_tier_saturates():
    steps = 600
    _, unloaded = simulate(PriorityFairPolicy(), periodic("chat", 25, steps, priority=-10), steps)
    for name, policy in (("fcfs", FcfsPolicy()), ("priority", PriorityFairPolicy())):
        workload = merged(periodic("chat", 25, steps, priority=-10), periodic("batch", 0.5, steps, priority=10))
        _, ttft = simulate(policy, workload, steps)
        worst = max(ttft["chat"])
        if name == "priority":
            assert worst <= 2 * max(unloaded["chat"]), (ttft["chat"], unloaded["chat"])
            assert len(ttft["chat"]) == len(unloaded["chat"])
        else:
            assert worst > 10 * max(unloaded["chat"])


def test_an_idle_tenant_banks_no_credit():
    counters = VirtualTokenCounters()
    counters.join(0, "A")
    counters.charge_output(0, "A", 1000)
    counters.join(0, "B")  # B joins while A has work: lifted to A's counter, not 0
    assert counters.counter(0, "B") == counters.counter(0, "A")
    counters.leave(0, "A")
    counters.leave(0, "B")
    counters.join(0, "C")  # nobody has work: lifted to the last leaver's counter
    assert counters.counter(0, "C") == counters.counter(0, "B")


def test_fair_share_state_is_released_when_requests_leave():
    policy = PriorityFairPolicy()
    scheduler = Scheduler(KVCacheManager(64, 4), 4, 100, policy=policy)
    made = request(tenant="A")
    scheduler.add(made)
    step(scheduler)
    scheduler.finish(made, RequestStatus.FINISHED_ABORTED)
    scheduler.finish(made, RequestStatus.FINISHED_ABORTED)  # twice: counted once
    assert policy.counters._tiers[0].pending == {}
    assert policy._prompt_charged == set()


def test_a_worse_tier_prefills_in_short_chunks_while_a_better_tier_is_active():
    """--lower-tier-prefill-chunk: a step cannot be interrupted, so while a better tier is active a
    worse tier's prompt goes in chunks of at most the limit; alone, or with no limit, it takes the
    whole budget. The better tier itself is never limited."""
    def scheduler_with(limit):
        return Scheduler(KVCacheManager(64, 4), 8, 100,
                         policy=PriorityFairPolicy(lower_tier_prefill_chunk=limit))

    alone = scheduler_with(8)
    background = request(40, priority=10)
    alone.add(background)
    assert [c.num_new_tokens for c in alone.schedule().chunks] == [40]  # no better tier seen

    scheduler = scheduler_with(8)
    interactive, background = request(30, priority=-10), request(40, priority=10)
    scheduler.add(interactive)
    scheduler.add(background)
    first = scheduler.schedule()
    assert [(c.request, c.num_new_tokens) for c in first.chunks] == [(interactive, 30), (background, 8)]
    scheduler.update_from_output(first, {interactive: SampledTokens([1], None)})
    second = scheduler.schedule()  # the running prefill continues in chunks of 8 too
    assert [(c.request, c.num_new_tokens) for c in second.chunks] == [(interactive, 1), (background, 8)]

    unlimited = scheduler_with(None)
    interactive, background = request(30, priority=-10), request(40, priority=10)
    unlimited.add(interactive)
    unlimited.add(background)
    assert [c.num_new_tokens for c in unlimited.schedule().chunks] == [30, 40]

    expired = PriorityFairPolicy(lower_tier_prefill_chunk=8, active_window_s=0.0)
    late = Scheduler(KVCacheManager(64, 4), 8, 100, policy=expired)
    late.add(request(4, priority=-10))
    step(late)
    background = request(40, priority=10)
    late.add(background)
    assert [c.num_new_tokens for c in late.schedule().chunks if c.request is background] == [40]


def test_the_lower_tier_chunk_defaults_to_16_on_a_cpu_and_0_turns_it_off(tiny_llama):
    from kvik.core.config import ConfigError, EngineArgs
    from kvik.engine.llm import LLM

    assert LLM(str(tiny_llama), show_progress=False).engine.core.scheduler.policy.lower_tier_prefill_chunk == 16
    off = LLM(str(tiny_llama), show_progress=False, lower_tier_prefill_chunk=0)
    assert off.engine.core.scheduler.policy.lower_tier_prefill_chunk is None
    with pytest.raises(ConfigError, match="lower_tier_prefill_chunk"):
        EngineArgs(model=str(tiny_llama), lower_tier_prefill_chunk=-1)
    with pytest.raises(ConfigError, match="lower_tier_prefill_chunk: expected an integer"):
        EngineArgs(model=str(tiny_llama), lower_tier_prefill_chunk=True)
    assert make_policy("priority", "cuda").lower_tier_prefill_chunk is None  # off on a GPU unless given
    assert make_policy("priority", "cuda", lower_tier_prefill_chunk=32).lower_tier_prefill_chunk == 32


@pytest.mark.parametrize("value, message", [("-1", "must be 0 (off) or more, got -1"), ("x", "invalid int value")])
def test_kvik_serve_refuses_a_bad_lower_tier_chunk_before_loading_anything(value, message):
    import subprocess

    from tests.support.processes import KVIK

    result = subprocess.run([*KVIK, "serve", "--lower-tier-prefill-chunk", value], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0 and message in result.stderr, result.stderr[-500:]
