"""After any mix of finished, aborted and preempted requests every block is free or cached."""

from __future__ import annotations

import random

import pytest

from kvik import LLM, SamplingParams
from kvik.core.sampling_params import OutputKind
from kvik.engine import multi_step as multi_step_module


def assert_no_leaks(engine) -> None:
    pool = engine.core.kv.pool
    pool.check_invariants()
    assert not engine.core.kv.block_tables, "a finished sequence still holds a block table"
    assert all(block.ref_count == 0 for block in pool.blocks)
    assert pool.num_free_blocks == pool.num_blocks  # every block free (cached ones are evictable)


def drive_random_mix(engine, rng: random.Random, steps: int, make_prompt) -> None:
    """Step `engine` through a random mix of requests (greedy and sampled, n of 1 or 2, stop strings,
    ignore_eos) that finish, get aborted, or get preempted by a small pool; then drain it. The block
    pool's invariants are checked after every step. `make_prompt(rng)` draws a prompt's token ids."""
    live: list[str] = []
    for step in range(steps):
        if rng.random() < 0.5 and len(live) < 20:
            request_id = f"req{step}"
            prompt = make_prompt(rng)
            params = SamplingParams(temperature=rng.choice([0, 1.0]), n=rng.choice([1, 1, 2]),
                                    max_tokens=rng.randrange(1, 30), ignore_eos=rng.random() < 0.5,
                                    stop=["e"] if rng.random() < 0.3 else [],
                                    output_kind=OutputKind.DELTA)
            engine.add_request(request_id, prompt, params)
            live.append(request_id)
        if live and rng.random() < 0.15:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        for output in engine.step():
            if output.finished and output.request_id in live:
                live.remove(output.request_id)
        engine.core.kv.pool.check_invariants()
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("steps", [1, 8])
def test_random_mix_of_finish_abort_and_preemption(tiny_llama, steps, monkeypatch):
    # A pool of 24 blocks of 4 tokens for up to 12 sequences forces preemption. With runs of up
    # to 8 forwards (multi-step decoding, as long as the count allows however slow the machine),
    # sequences finish in fewer steps and blocks go to runs ahead of time.
    monkeypatch.setattr(multi_step_module, "MULTI_STEP_SECONDS", 1e9)
    llm = LLM(str(tiny_llama), show_progress=False, block_size=4, max_model_len=64,
              kv_cache_memory=24 * 4096, max_num_seqs=12, max_num_batched_tokens=48,
              num_scheduler_steps=steps)
    engine = llm.engine
    plans = []
    schedule = engine.core.scheduler.schedule

    def planned():
        out = schedule()
        plans.append(out.num_steps)
        return out

    engine.core.scheduler.schedule = planned
    drive_random_mix(engine, random.Random(0), 150,
                     lambda rng: [rng.randrange(1, 500) for _ in range(rng.randrange(1, 30))])
    if steps == 1:
        assert engine.core.scheduler.num_preemptions > 0
    else:
        assert sum(n > 1 for n in plans) > 10  # runs happened between the arrivals and aborts
    assert_no_leaks(engine)


def test_abort_of_waiting_and_running_requests(tiny_llama):
    llm = LLM(str(tiny_llama), show_progress=False, max_num_seqs=1)
    engine = llm.engine
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    engine.add_request("running", "Hello there", params)
    engine.add_request("waiting", "General Kenobi", params)
    engine.step()
    assert engine.core.kv.block_tables  # the running one holds blocks
    assert engine.abort_request("running") and engine.abort_request("waiting")
    assert not engine.abort_request("never-existed")
    assert_no_leaks(engine)
    assert engine.step() == []
