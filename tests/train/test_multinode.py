"""Multi-node training as torchrun runs it: two agents (`torchrun --nnodes 2`, one process each)
rendezvous through c10d at one address, as two machines would. The run stops, resumes from its
checkpoint with the same two-node command, and ends on the losses of a single process that reads
the same global batches. The "nodes" run in private network and PID namespaces (see
torchrun_two_nodes.sh), so the rendezvous listens on a loopback of their own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.train.helpers import pretrain_config, train_losses

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("torchrun_two_nodes.sh")
NAMESPACES = ["unshare", "--net", "--pid", "--mount-proc", "--fork", "--kill-child"]


def _namespaces_or_skip() -> None:
    probe = subprocess.run([*NAMESPACES, "true"], capture_output=True, text=True)
    if probe.returncode != 0 or not shutil.which("ip"):
        message = f"cannot create private namespaces for the two nodes: {probe.stderr.strip() or 'no ip'}"
        if os.environ.get("KVIK_TEST_REQUIRE_SERVICES") == "1":
            pytest.fail(message)
        pytest.skip(message)


def _two_nodes(config: dict, run_dir: Path, *train_args: str) -> list[str]:
    """Both nodes' output, after both exited 0."""
    run_dir.mkdir()
    config_path = run_dir / "train.json"
    config_path.write_text(json.dumps(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([*NAMESPACES, "bash", str(SCRIPT), str(run_dir), sys.executable,
                             "--config", str(config_path), *train_args],
                            capture_output=True, text=True, env=env, timeout=400)
    logs = [(run_dir / f"node-{i}.log").read_text() for i in range(2)]
    assert result.returncode == 0, result.stderr[-2000:] + "\n".join(log[-3000:] for log in logs)
    return logs


def test_two_nodes_train_stop_and_resume(shards_dir: Path, tmp_path: Path, single_process_losses) -> None:
    _namespaces_or_skip()
    out = tmp_path / "out"  # one directory both nodes see: a shared filesystem on real machines
    # 2 ranks x 4 samples read the same 8 samples per step as 1 rank x 8 (see kvik.train.batches).
    config = pretrain_config(out, shards_dir, max_steps=4, micro_batch_size=4,
                             checkpoint={"every_steps": 2, "keep_last": 2},
                             distributed={"strategy": "ddp", "timeout_s": 60})
    first = "\n".join(_two_nodes(config, tmp_path / "first", "--stop-after-steps", "2"))
    assert "stopped" in first and "at step 2" in first
    assert (out / "checkpoints" / "step-00000002").is_dir()

    second = "\n".join(_two_nodes(config, tmp_path / "second"))
    assert "resumed from" in second and "step-00000002" in second
    assert train_losses(out) == pytest.approx(single_process_losses, abs=2e-4)
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["steps"] == 4 and summary["world_size"] == 2
