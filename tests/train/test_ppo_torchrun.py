"""PPO under torchrun (2 processes, gloo on CPU, DDP), each rank sampling its share of the rollouts
on its own kvik engine: a worker killed mid-run is replaced by torchrun's restart, which resumes from
the last checkpoint (weights, optimizer, KL coefficient; the engine gets the restored weights) and
finishes with every iteration logged exactly once."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from tests.train.ppo_helpers import ppo_config
from tests.train.preference_helpers import write_prompts
from tests.train.test_torchrun import _finish, _torchrun, _worker_pids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_killed_ppo_worker_resumes_from_its_checkpoint_and_finishes(tiny_llama: Path,
                                                                    tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "prompts.jsonl", 64)
    out = tmp_path / "out"
    config = ppo_config(out, tiny_llama, prompts, max_steps=10,
                        ppo={"rollout_batch_size": 16, "minibatch_size": 8, "ppo_epochs": 2},
                        checkpoint={"every_steps": 2, "keep_last": 2},
                        distributed={"strategy": "ddp", "timeout_s": 30})
    started = time.monotonic()
    process = _torchrun(config, tmp_path, torchrun_args=("--max-restarts", "2", "--monitor-interval", "0.5"))
    metrics = out / "metrics.jsonl"
    killed_at = None
    while time.monotonic() - started < 400 and process.poll() is None:
        steps = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if steps >= 5:  # past the checkpoints at iterations 2 and 4
            os.kill(_worker_pids(process.pid)[1], signal.SIGKILL)
            killed_at = steps
            break
        time.sleep(0.1)
    assert killed_at is not None, "the run ended or stalled before the worker could be killed"
    output = _finish(process, timeout=600)

    assert "resumed from" in output
    resumed_at = int(output.split("resumed from")[1].split("step-")[1][:8])
    assert 4 <= resumed_at <= killed_at
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 11))  # none lost, none twice
    assert all(r["logprob_gap"] <= 1e-4 for r in records)  # the restarted engines were synced
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["steps"] == 10 and summary["world_size"] == 2
