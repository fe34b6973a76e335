"""Inputs for the data-pipeline tests: clean prose that passes every default rule, and a pipeline
config with everything but the stage under test switched off."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CLEAN_TEXTS = [
    "The river town wakes slowly in the early spring, when the ice on the water begins to break.\n"
    "Fishermen check their nets along the wooden docks and talk about the weather from the west.\n"
    "Children walk to the old school on the hill, carrying books and lunches wrapped in paper.\n"
    "At noon the bakery opens its doors, and the smell of fresh bread drifts over the square.\n"
    "Travelers who arrive by train often stay for a night at the small inn beside the station.\n"
    "In the evening, families gather on their porches to watch the sun go down behind the hills.\n"
    "Nobody remembers exactly when the first bridge was built, but everyone has a story about it.",
    "Our laboratory studies how bees find their way home after long flights across open fields.\n"
    "Each morning we mark a few hundred workers with small dots of paint on their backs.\n"
    "Then we release them at different distances from the hive and record the time of return.\n"
    "Bees that have seen the landscape before come back faster than those that have not.\n"
    "We think they learn the position of the sun and the shape of the horizon around the hive.\n"
    "Next year we want to test whether strong wind changes the routes that they choose.\n"
    "The results so far suggest that memory matters as much as instinct for these insects.",
]


def write_jsonl(path: Path, docs: list[tuple[str, str]]) -> Path:
    """docs: (id, text) pairs."""
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in docs))
    return path


def only_stages(inputs: Path, out: Path, **sections: Any) -> dict[str, Any]:
    """A pipeline config dict with every per-document filter off unless given in `sections`."""
    config: dict[str, Any] = {
        "inputs": [{"path": str(inputs), "id_field": "id"}],
        "output_dir": str(out),
        "workers": 1,
        "gopher_quality": {"enabled": False},
        "gopher_repetition": {"enabled": False},
        "c4": {"enabled": False},
        "fineweb": {"enabled": False},
        "pii": {"enabled": False},
        "exact_dedup": {"enabled": False},
        "near_dedup": {"enabled": False},
    }
    config.update(sections)
    return config


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
