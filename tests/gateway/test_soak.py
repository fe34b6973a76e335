"""Must-show 5 of issue 10, short: `bench/soak_gateway.py` for 75 s (the full run is 10 minutes).
Mixed good and bad traffic through the gateway to two real kvik serve replicas, one killed and one
SIGSTOPped in the middle: no request hangs, no accepted request is lost, memory stays bounded, and
the usage rows equal the tokens the clients received (the script checks all four)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gateway.harness import REPO

pytest.importorskip("torch")  # the replicas are kvik serve


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_soak_of_75_seconds_with_a_killed_and_a_stopped_replica(tmp_path: Path) -> None:
    summary_path = tmp_path / "soak.json"
    result = subprocess.run([sys.executable, str(REPO / "bench" / "soak_gateway.py"), "--duration", "75",
                             "--json", str(summary_path)], cwd=REPO, capture_output=True, text=True, timeout=850)
    assert summary_path.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    print(json.dumps({k: summary[k] for k in ("requests", "verdicts", "latency_s", "memory", "accounting")}))
    assert result.returncode == 0, summary["failures"]
    assert summary["verdicts"].get("ok", 0) > 0 and summary["verdicts"].get("error", 0) > 0
    assert [what.split()[0] for _, what in summary["events"]][:2] == ["SIGKILL", "restarting"]
    assert any(what.startswith("SIGSTOP") for _, what in summary["events"])
