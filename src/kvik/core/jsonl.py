"""Reading JSONL files line by line, with errors that name the file and line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvik.core.errors import ConfigError


def jsonl_values(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number from 1, parsed value) for each non-blank line of the file. A line that is not
    JSON raises ConfigError "path:line: not valid JSON (...)"; what each value must be is the
    caller's to check (and to report with the same "path:line" prefix)."""
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{number}: not valid JSON ({exc.msg})") from exc
            yield number, value
