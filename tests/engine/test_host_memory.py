"""keep_step_memory: a step's large tensors are not faulted in anew every step (glibc only).

Each case runs in a child process, since the settings are process-wide and permanent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kvik.engine.host_memory import keep_step_memory

CHILD = textwrap.dedent("""
    import json, resource, sys, torch
    from kvik.engine.host_memory import keep_step_memory
    tuned = keep_step_memory() if sys.argv[1] == "tuned" else False
    def faults(step):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step()
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    def step():
        # a 2048 x 4096 float32 activation, written and freed as a prompt step's gate/up output is
        x = torch.empty(2048, 4096)
        x.fill_(1.0)
        del x
    # The first steps fault in either case: tuned, the heap grows until its freed blocks line up
    # again with posix_memalign's padded requests (about ten steps here), then stays (tested to 300).
    counts = sorted([faults(step) for _ in range(40)][20:])
    print(json.dumps({"tuned": tuned, "faults": counts[10]}))  # the median step
""")


def run_child(mode: str) -> dict:
    env = {**os.environ, "KVIK_MALLOC_TUNING": "1"}  # the tuned child tunes, whatever the shell says
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, env=env,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_steps_activations_stay_mapped_once_tuned():
    default, tuned = run_child("default"), run_child("tuned")
    if not tuned["tuned"]:
        pytest.skip("the C library is not glibc")
    # 32 MiB is 8192 pages of 4 KiB: glibc maps and unmaps the block each time by default.
    assert default["faults"] > 4000, default
    assert tuned["faults"] < default["faults"] / 20, (default, tuned)


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("KVIK_MALLOC_TUNING", "0")
    assert keep_step_memory() is False
