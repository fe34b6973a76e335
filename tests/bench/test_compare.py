"""`kvik bench compare`'s single-stream decode measurement, run small on the tiny model: it pairs
every decode step with a read of the same bytes and reports both, in a child process of its own."""

from __future__ import annotations

import json

import pytest

from kvik import LLM
from kvik.bench import compare
from kvik.bench.compare import run_decode, single_stream_decode
from kvik.bench.roofline import ModelShape
from kvik.engine import multi_step as multi_step_module
from kvik.model.transforms.screened_head import SCREEN_ATTRIBUTE


def test_decode_pairs_each_step_with_a_read(tiny_llama):
    bytes_per_token = ModelShape.from_model_dir(str(tiny_llama)).decode_bytes_per_token()
    result = single_stream_decode(str(tiny_llama), bytes_per_token, prompt_len=8, tokens=12, windows=3)
    assert len(result["window_fractions"]) == 3
    assert result["decode_tokens_per_second"] > 0 and result["read_bandwidth"] > 0
    # The whole-run fraction is the windows' pooled ratio, so it lies within their range.
    assert min(result["window_fractions"]) <= result["decode_bandwidth_fraction"] <= max(result["window_fractions"])


def test_the_pairs_read_only_what_a_greedy_step_reads(tiny_llama):
    # Greedy runs read the LM head's int8 copy (screened_head) in all but their first forward: the
    # paired reads leave those bytes out, or the fraction would credit bytes no step read.
    llm = LLM(str(tiny_llama), show_progress=False, kv_cache_memory=2**24)
    core = llm.engine.core
    head = core.model.lm_head
    screen = head.__dict__.get(SCREEN_ATTRIBUTE)
    if not screen:
        pytest.skip("no int8 copy of the LM head here (no compiled kernels or packed GEMV)")
    steps = core.args.scheduler_steps()
    expected = int((steps - 1) / steps * (head.nbytes - screen.copy.nbytes))
    assert compare.screened_head_discount(core) == expected > 0
    shape_bytes = ModelShape.from_model_dir(str(tiny_llama)).decode_bytes_per_token()
    result = single_stream_decode(str(tiny_llama), shape_bytes, prompt_len=8, tokens=8, windows=2)
    assert result["bytes_per_token"] == shape_bytes - expected


def test_decode_runs_in_its_own_process(tiny_llama, tmp_path):
    bytes_per_token = ModelShape.from_model_dir(str(tiny_llama)).decode_bytes_per_token()
    result = run_decode(str(tiny_llama), bytes_per_token, tmp_path)
    assert result == json.loads((tmp_path / "decode.json").read_text())
    assert len(result["window_fractions"]) == 8 and result["decode_bandwidth_fraction"] > 0


def logging_steps(llm: LLM, order: list[str], monkeypatch):
    """llm's engine, with each step logged as "s" in `order`."""
    engine = llm.engine
    step = engine.step

    def logged_step():
        order.append("s")
        return step()

    monkeypatch.setattr(engine, "step", logged_step)
    return engine


def test_paired_steps_run_in_bursts_of_steps_then_reads(tiny_llama, monkeypatch):
    """With burst=4, ten decode steps come as 4 steps then 4 reads, 4 and 4, 2 and 2: each step in
    its steady state; every step and every read is timed."""
    order: list[str] = []
    sizes: list[int] = []

    def fake_reader(buffer):
        sizes.append(buffer.numel() * buffer.element_size())
        return lambda: order.append("r")

    monkeypatch.setattr(compare, "stream_reader", fake_reader)
    llm = LLM(str(tiny_llama), show_progress=False, kv_cache_memory=2**26, num_scheduler_steps=1)
    engine = logging_steps(llm, order, monkeypatch)
    decode_times, read_times = compare.paired_decode_steps(engine, 8, 10, 4096, burst=4)
    assert len(decode_times) == len(read_times) == 10
    # One read to page the buffer in and the prefill step first, then the bursts; steps after the
    # last read only finish the request.
    assert "".join(order).rstrip("s") == "rs" + "ssssrrrr" * 2 + "ssrr"
    assert sizes == [4096]
    # A read no cache serves (STREAM's rule): the buffer grows to min_read_bytes, each read's time
    # counted for the step's bytes only.
    compare.paired_decode_steps(engine, 8, 2, 4096, burst=2, min_read_bytes=2**20)
    assert sizes == [4096, 2**20]
    with pytest.raises(ValueError, match="burst"):
        compare.paired_decode_steps(engine, 8, 4, 4096, burst=0)


def test_paired_steps_count_the_tokens_of_multi_step_runs(tiny_llama, monkeypatch):
    """A step that runs 4 forwards (multi-step decoding) makes 4 tokens: it shares its time among
    them and is followed by 4 reads, so a token's time and its read still pair up."""
    order: list[str] = []
    monkeypatch.setattr(compare, "stream_reader", lambda buffer: lambda: order.append("r"))
    monkeypatch.setattr(multi_step_module, "MULTI_STEP_SECONDS", 1e9)  # runs however slow the machine
    llm = LLM(str(tiny_llama), show_progress=False, kv_cache_memory=2**26, num_scheduler_steps=4)
    engine = logging_steps(llm, order, monkeypatch)
    decode_times, read_times = compare.paired_decode_steps(engine, 8, 10, 4096, burst=4)
    assert len(decode_times) == len(read_times) == 10
    # The prefill, then runs of 4, 4 and the 2 max_tokens leaves, each followed by its reads.
    assert "".join(order).rstrip("s") == "rs" + "srrrr" * 2 + "srr"
    assert decode_times[0] == decode_times[3] and decode_times[8] == decode_times[9]
