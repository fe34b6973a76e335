"""The same command on 2 processes under torchrun (gloo on CPU): DDP and FSDP2 compute the losses
of the single-process run with the same global batch (FSDP across a stop and resume), and a worker
killed mid-run is replaced by torchrun's restart, which resumes from the last checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.train.helpers import pretrain_config, train_losses

pytestmark = pytest.mark.slow


def _torchrun(config: dict, tmp_path: Path, *train_args: str,
              torchrun_args: tuple[str, ...] = ()) -> subprocess.Popen:
    path = tmp_path / "train.json"
    path.write_text(json.dumps(config))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               *torchrun_args, "-m", "kvik.cli.main", "train", "--config", str(path), *train_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # A session of its own, so a failed test can end torchrun and its workers together.
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)


def _finish(process: subprocess.Popen, timeout: float) -> str:
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"torchrun did not finish in {timeout}s:\n{output[-4000:]}")
    assert process.returncode == 0, output[-4000:]
    return output


def _two_process_config(out: Path, shards_dir: Path, strategy: str) -> dict:
    # 2 ranks x 4 samples read the same 8 samples per step as 1 rank x 8 (see kvik.train.batches).
    return pretrain_config(out, shards_dir, max_steps=4, micro_batch_size=4,
                           distributed={"strategy": strategy, "timeout_s": 60})


def test_ddp_matches_one_process_with_the_same_global_batch(shards_dir: Path, tmp_path: Path,
                                                            single_process_losses) -> None:
    from transformers import AutoModelForCausalLM

    _finish(_torchrun(_two_process_config(tmp_path / "out", shards_dir, "ddp"), tmp_path), timeout=240)
    assert train_losses(tmp_path / "out") == pytest.approx(single_process_losses, abs=2e-4)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").num_parameters() > 0


def test_fsdp_stops_resumes_and_matches_one_process(shards_dir: Path, tmp_path: Path,
                                                    single_process_losses) -> None:
    """FSDP2 shards the weights and optimizer state; the checkpoint holds them whole, and the
    resumed run continues the same curve."""
    from transformers import AutoModelForCausalLM

    config = _two_process_config(tmp_path / "out", shards_dir, "fsdp")
    output = _finish(_torchrun(config, tmp_path, "--stop-after-steps", "2"), timeout=240)
    assert "stopped" in output and "at step 2" in output
    output = _finish(_torchrun(config, tmp_path), timeout=240)
    assert "resumed from" in output and "step-00000002" in output
    assert train_losses(tmp_path / "out") == pytest.approx(single_process_losses, abs=2e-4)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").num_parameters() > 0


def _worker_pids(torchrun_pid: int) -> dict[int, int]:
    """local rank -> pid of torchrun's worker processes."""
    import psutil

    workers = {}
    for child in psutil.Process(torchrun_pid).children(recursive=True):
        try:
            rank = child.environ().get("LOCAL_RANK")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if rank is not None:
            workers[int(rank)] = child.pid
    return workers


def test_killed_worker_is_restarted_from_the_last_checkpoint(shards_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    config = pretrain_config(out, shards_dir, max_steps=150, micro_batch_size=4,
                             checkpoint={"every_steps": 5, "keep_last": 2},
                             distributed={"strategy": "ddp", "timeout_s": 30})
    started = time.monotonic()
    process = _torchrun(config, tmp_path, torchrun_args=("--max-restarts", "2", "--monitor-interval", "0.5"))
    metrics = out / "metrics.jsonl"
    killed_at = None
    while time.monotonic() - started < 120 and process.poll() is None:
        steps = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if steps >= 12:  # past the checkpoints at steps 5 and 10
            os.kill(_worker_pids(process.pid)[1], signal.SIGKILL)
            killed_at = steps
            break
        time.sleep(0.05)
    assert killed_at is not None, "the run ended or stalled before the worker could be killed"
    output = _finish(process, timeout=240)

    assert "resumed from" in output and "step-000000" in output
    resumed_at = int(output.split("resumed from")[1].split("step-")[1][:8])
    assert 10 <= resumed_at <= killed_at
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, 151))  # no step lost, none logged twice
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["steps"] == 150 and summary["world_size"] == 2
    assert time.monotonic() - started < 300
