"""examples/alignment runs end to end (quick settings): SFT, rule-labelled comparisons, agreement
report, filtered and versioned splits, reward model, PPO on kvik's engine, `kvik serve` of the
policy, and the win rate against the SFT model judged by the reward model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "alignment"


def test_alignment_example_runs_end_to_end(tmp_path: Path) -> None:
    work = tmp_path / "work"
    result = subprocess.run([sys.executable, str(EXAMPLE / "run.py"), "--workdir", str(work), "--quick"],
                            capture_output=True, text=True, timeout=1500,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    summary = json.loads((work / "summary.json").read_text())
    assert summary["agreement"] is not None and 0.0 < summary["agreement"] <= 1.0
    assert summary["reward_model"] >= 0.8  # held-out accuracy on the rule
    assert summary["ppo"]["steps"] == 6
    assert 0.0 <= summary["win_rate"]["win_rate"] <= 1.0 and summary["win_rate"]["prompts"] > 0
    manifest = json.loads((work / "prefs" / "manifest.json").read_text())
    assert manifest["dropped"].get("low_agreement", 0) > 0  # the careless annotator's items
    assert (work / "agreement" / "agreement.png").exists()
    assert (work / "rm" / "config.json").exists() and (work / "ppo" / "value_head.safetensors").exists()
