"""Running the scripts under bench/ as a user does: a fresh interpreter, output captured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run_bench_script(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`python bench/<name> args...`; the caller checks returncode, stdout and stderr."""
    return subprocess.run([sys.executable, str(BENCH / name), *args], capture_output=True, text=True,
                          timeout=timeout)
