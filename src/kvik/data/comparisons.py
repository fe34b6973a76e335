"""`kvik data comparisons`: validate, filter by agreement, split and version a comparisons file.

Stages, in order:
1. validate: every line parses as the comparisons format (kvik.core.comparisons), ids unique;
2. filter: items with fewer than `min_labels` labels, or whose annotators' agreement with the
   majority is below `min_agreement` (a tie counts as 0), are dropped (to dropped.jsonl with the
   reason) or, with `low_agreement: flag`, kept with `meta.flag` saying why;
3. split: by a seeded hash of the *prompt*, so every comparison of one prompt lands in the same
   split (no prompt seen in training is scored as held out), and the split of an item does not
   change when other items are added;
4. version: manifest.json records each split file's sha256 and a version hashed from them, as the
   token shards do: the same kept items give the same version whatever the paths.

The agreement report of the input (`kvik data agreement`) is written beside them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvik.core.comparisons import FORMAT, MANIFEST, Comparison, read_comparisons, write_comparisons
from kvik.core.config_files import file_sha256
from kvik.core.errors import ConfigError
from kvik.data.agreement import measure_agreement, write_agreement_report

LOW_AGREEMENT_ACTIONS = ("drop", "flag")


@dataclass(slots=True)
class ComparisonsConfig:
    input: str
    output_dir: str
    val_fraction: float = 0.1
    seed: int = 0
    min_labels: int = 1
    min_agreement: float = 0.0  # fraction of an item's annotators agreeing with its majority
    low_agreement: str = "drop"  # drop | flag

    def validate(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError("val_fraction: must be in [0, 1)")
        if self.min_labels < 0:
            raise ConfigError("min_labels: must be at least 0")
        if not 0.0 <= self.min_agreement <= 1.0:
            raise ConfigError("min_agreement: must be in [0, 1]")
        if self.low_agreement not in LOW_AGREEMENT_ACTIONS:
            raise ConfigError(f"low_agreement: {self.low_agreement!r} is not one of "
                              f"{', '.join(LOW_AGREEMENT_ACTIONS)}")


@dataclass(slots=True)
class ComparisonsResult:
    output_dir: Path
    manifest: dict[str, Any]
    dropped: dict[str, int] = field(default_factory=dict)


def split_of(prompt: str, seed: int, val_fraction: float) -> str:
    digest = hashlib.sha256(f"{seed}\0{prompt}".encode()).digest()
    return "val" if int.from_bytes(digest[:8], "big") / 2**64 < val_fraction else "train"


def low_agreement_reason(item: Comparison, config: ComparisonsConfig) -> str | None:
    if len(item.labels) < config.min_labels:
        return f"too_few_labels: {len(item.labels)} < {config.min_labels}"
    if item.labels and item.agreement() < config.min_agreement:
        return f"low_agreement: {item.agreement():.2f} < {config.min_agreement}"
    if item.labels and not item.preference_pairs():
        return "no_majority: the annotators' first choices tie"
    return None


def prepare_comparisons(config: ComparisonsConfig) -> ComparisonsResult:
    config.validate()
    items = read_comparisons(config.input)
    if not items:
        raise ConfigError(f"{config.input}: no comparisons in the file")
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[Comparison]] = {"train": [], "val": []}
    dropped_counts: dict[str, int] = {}
    with open(out / "dropped.jsonl", "w", encoding="utf-8") as dropped_file:
        for item in items:
            reason = low_agreement_reason(item, config)
            if reason is not None and config.low_agreement == "drop":
                kind = reason.split(":", 1)[0]
                dropped_counts[kind] = dropped_counts.get(kind, 0) + 1
                dropped_file.write(json.dumps({"reason": reason, "item": item.to_dict()},
                                              ensure_ascii=False, sort_keys=True) + "\n")
                continue
            if reason is not None:
                item = Comparison(item.id, item.prompt, item.responses, item.labels, item.models,
                                  {**item.meta, "flag": reason})
            splits[split_of(item.prompt, config.seed, config.val_fraction)].append(item)
    files: dict[str, Any] = {}
    for name, kept in splits.items():
        path = out / f"{name}.jsonl"
        write_comparisons(path, kept)
        files[name] = {"file": path.name, "items": len(kept),
                       "pairs": sum(len(item.preference_pairs()) for item in kept),
                       "sha256": file_sha256(path)}
    version = hashlib.sha256(json.dumps({n: f["sha256"] for n, f in files.items()},
                                        sort_keys=True).encode()).hexdigest()[:16]
    manifest = {"format": FORMAT, "version": version, "splits": files,
                "input": {"items": len(items), "sha256": file_sha256(Path(config.input))},
                "dropped": dict(sorted(dropped_counts.items())),
                "config": {"val_fraction": config.val_fraction, "seed": config.seed,
                           "min_labels": config.min_labels, "min_agreement": config.min_agreement,
                           "low_agreement": config.low_agreement}}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    write_agreement_report(measure_agreement(items), out)
    return ComparisonsResult(out, manifest, dropped_counts)
