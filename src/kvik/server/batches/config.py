"""Settings of the Batch API (`kvik serve --batch-*`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True)
class BatchConfig:
    db_path: Path | None  # None: the Batch API is off
    max_file_bytes: int = 100 * 2**20
    max_lines: int = 50_000
    concurrency: int = 64  # lines in the engine at once, all batches together
