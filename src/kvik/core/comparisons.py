"""The comparisons format: human (or rule) preferences between answers to one prompt, as JSONL.

One line per item:

    {"id": "c-17", "prompt": "Name a colour.",
     "responses": ["Red.", "I like turtles."],
     "labels": [{"annotator": "ann-1", "choice": 0},
                {"annotator": "ann-2", "ranking": [0, 1]}],
     "models": ["sft", "base"], "meta": {...}}

- `prompt`: the user's text (the chat template turns it into a user turn where the model has one).
- `responses`: two or more distinct answers.
- `labels`: one per annotator (an annotator labels an item at most once). `choice` is the index of
  the best response; `ranking` lists every response index once, best first. An annotator who did
  not label an item is simply absent from it: agreement statistics treat that as missing.
- `models` (optional): which model wrote each response; `meta` (optional): anything, kept as is.

The data stages (`kvik.data.comparisons`), the agreement report, `kvik label` and the reward/DPO
tasks all read and write this one format; it lives in core so each of them can without importing
the others.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from kvik.core.config_files import file_sha256
from kvik.core.errors import ConfigError
from kvik.core.jsonl import jsonl_values

FORMAT = "kvik-comparisons/1"
MANIFEST = "manifest.json"  # of a directory written by `kvik data comparisons`


@dataclass(frozen=True, slots=True)
class Label:
    annotator: str
    ranking: tuple[int, ...]  # response indices best first; a bare `choice` is (choice,)

    @property
    def choice(self) -> int:
        """The response this annotator liked best."""
        return self.ranking[0]

    @property
    def is_full_ranking(self) -> bool:
        return len(self.ranking) > 1

    def to_dict(self) -> dict[str, Any]:
        if self.is_full_ranking:
            return {"annotator": self.annotator, "ranking": list(self.ranking)}
        return {"annotator": self.annotator, "choice": self.choice}


@dataclass(frozen=True, slots=True)
class Comparison:
    id: str
    prompt: str
    responses: tuple[str, ...]
    labels: tuple[Label, ...]
    models: tuple[str, ...] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        record: dict[str, Any] = {"id": self.id, "prompt": self.prompt,
                                  "responses": list(self.responses),
                                  "labels": [label.to_dict() for label in self.labels]}
        if self.models is not None:
            record["models"] = list(self.models)
        if self.meta:
            record["meta"] = self.meta
        return record

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, sort_keys=True)

    def majority_choice(self) -> int | None:
        """The response most annotators put first; None on a tie or without labels."""
        counts = Counter(label.choice for label in self.labels).most_common()
        if not counts or (len(counts) > 1 and counts[0][1] == counts[1][1]):
            return None
        return counts[0][0]

    def agreement(self) -> float:
        """Fraction of this item's annotators whose first choice is the majority's (0 on a tie)."""
        majority = self.majority_choice()
        if majority is None:
            return 0.0
        return sum(label.choice == majority for label in self.labels) / len(self.labels)

    def preference_pairs(self) -> list[tuple[int, int]]:
        """(better, worse) response indices this item teaches a reward model.

        One annotator's full ranking gives every ordered pair of it, as InstructGPT trains on all
        K-choose-2 pairs of a ranking. Otherwise the majority's first choice beats every other
        response; an item without a majority teaches nothing."""
        if len(self.labels) == 1 and self.labels[0].is_full_ranking:
            order = self.labels[0].ranking
            return [(order[i], order[j]) for i in range(len(order)) for j in range(i + 1, len(order))]
        best = self.majority_choice()
        if best is None:
            return []
        return [(best, other) for other in range(len(self.responses)) if other != best]


def _fail(where: str, message: str) -> ConfigError:
    return ConfigError(f"{where}: {message}")


def _parse_label(raw: Any, num_responses: int, where: str) -> Label:
    if not isinstance(raw, dict):
        raise _fail(where, 'each label must be an object {"annotator", "choice" or "ranking"}')
    annotator = raw.get("annotator")
    if not isinstance(annotator, str) or not annotator.strip():
        raise _fail(where, "label.annotator must be a non-empty string")
    has_choice, has_ranking = "choice" in raw, "ranking" in raw
    if has_choice == has_ranking:
        raise _fail(where, f"label of {annotator!r} needs exactly one of 'choice' or 'ranking'")
    if has_choice:
        choice = raw["choice"]
        if not isinstance(choice, int) or isinstance(choice, bool) or not 0 <= choice < num_responses:
            raise _fail(where, f"label of {annotator!r}: choice must be a response index in "
                               f"[0, {num_responses})")
        return Label(annotator, (choice,))
    ranking = raw["ranking"]
    if (not isinstance(ranking, list) or sorted(ranking) != list(range(num_responses))
            or any(isinstance(r, bool) for r in ranking)):
        raise _fail(where, f"label of {annotator!r}: ranking must list each response index "
                           f"0..{num_responses - 1} exactly once, best first")
    return Label(annotator, tuple(ranking))


def parse_comparison(record: Any, where: str) -> Comparison:
    """Validate one decoded JSON record; errors name `where` (file:line) and the field to fix."""
    if not isinstance(record, dict):
        raise _fail(where, "each line must be a JSON object")
    unknown = set(record) - {"id", "prompt", "responses", "labels", "models", "meta"}
    if unknown:
        raise _fail(where, f"unknown field(s) {', '.join(sorted(unknown))}")
    item_id = record.get("id")
    if not isinstance(item_id, str) or not item_id:
        raise _fail(where, "id must be a non-empty string")
    prompt = record.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise _fail(where, "prompt must be a non-empty string")
    responses = record.get("responses")
    if (not isinstance(responses, list) or len(responses) < 2
            or not all(isinstance(r, str) and r.strip() for r in responses)):
        raise _fail(where, "responses must be a list of two or more non-empty strings")
    if len(set(responses)) != len(responses):
        raise _fail(where, "responses must differ from each other (a comparison of equal texts "
                           "teaches nothing)")
    labels_raw = record.get("labels", [])
    if not isinstance(labels_raw, list):
        raise _fail(where, "labels must be a list")
    labels = tuple(_parse_label(raw, len(responses), where) for raw in labels_raw)
    annotators = [label.annotator for label in labels]
    duplicated = sorted({a for a in annotators if annotators.count(a) > 1})
    if duplicated:
        raise _fail(where, f"annotator(s) {', '.join(duplicated)} labelled the item twice")
    models = record.get("models")
    if models is not None and (not isinstance(models, list) or len(models) != len(responses)
                               or not all(isinstance(m, str) for m in models)):
        raise _fail(where, "models, when given, must name one model (a string) per response")
    meta = record.get("meta", {})
    if not isinstance(meta, dict):
        raise _fail(where, "meta, when given, must be an object")
    return Comparison(item_id, prompt, tuple(responses), labels,
                      tuple(models) if models is not None else None, meta)


def iter_comparisons(path: str | Path) -> Iterator[Comparison]:
    """Comparisons of a JSONL file, validated line by line; ids must be unique in the file."""
    seen: dict[str, int] = {}
    for number, record in jsonl_values(path):
        where = f"{path}:{number}"
        item = parse_comparison(record, where)
        if item.id in seen:
            raise _fail(where, f"id {item.id!r} already used on line {seen[item.id]}")
        seen[item.id] = number
        yield item


def read_comparisons(path: str | Path) -> list[Comparison]:
    return list(iter_comparisons(path))


def write_comparisons(path: str | Path, items: Iterable[Comparison]) -> int:
    """Write `items` as JSONL (keys sorted, so equal content gives equal bytes); returns the count."""
    count = 0
    with open(path, "w", encoding="utf-8") as out:
        for item in items:
            out.write(item.to_json() + "\n")
            count += 1
    return count


@dataclass(frozen=True, slots=True)
class ComparisonSplits:
    train: list[Comparison]
    val: list[Comparison]
    version: str | None  # None for a bare JSONL file


def load_comparison_splits(path: str | Path) -> ComparisonSplits:
    """A directory written by `kvik data comparisons` (checked against its manifest), or one JSONL
    file used whole for training."""
    path = Path(path)
    if path.is_file():
        return ComparisonSplits(read_comparisons(path), [], None)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise ConfigError(f"{path}: neither a comparisons JSONL file nor a directory with {MANIFEST} "
                          "(run `kvik data comparisons`)")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"{manifest_path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    loaded: dict[str, list[Comparison]] = {}
    for name in ("train", "val"):
        entry = manifest["splits"][name]
        file = path / entry["file"]
        if file_sha256(file) != entry["sha256"]:
            raise ConfigError(f"{file}: content differs from {MANIFEST} (edited after "
                              "`kvik data comparisons`?); rerun it")
        loaded[name] = read_comparisons(file)
    return ComparisonSplits(loaded["train"], loaded["val"], manifest["version"])
