"""The gateway is torch-free: importing it, and its command, never loads torch or the engine."""

from __future__ import annotations

import subprocess
import sys


def test_gateway_imports_no_torch_engine_or_model() -> None:
    code = ("import sys, kvik.gateway.app, kvik.gateway.state, kvik.cli.gateway; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('kvik.engine', 'kvik.model', "
            "'kvik.server'))]; print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
