"""The comparisons format and `kvik data comparisons`: every malformed line is refused with its
line number and the field to fix; filtering by agreement drops or flags; the split keeps each
prompt on one side and does not move items when others are added; the version is a content hash;
rankings become all their pairs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvik.core.comparisons import (Comparison, Label, load_comparison_splits, parse_comparison,
                                   read_comparisons, write_comparisons)
from kvik.core.errors import ConfigError
from kvik.data.comparisons import ComparisonsConfig, prepare_comparisons


def _item(i: int, choices: list[int], prompt: str | None = None) -> Comparison:
    labels = tuple(Label(f"a{n}", (c,)) for n, c in enumerate(choices))
    return Comparison(f"c{i}", prompt or f"prompt {i}", (f"yes {i}", f"no {i}"), labels)


@pytest.mark.parametrize("record, fragment", [
    ({"id": "x", "prompt": "p", "responses": ["a"]}, "two or more"),
    ({"id": "x", "prompt": "p", "responses": ["a", "a"]}, "differ"),
    ({"id": "x", "prompt": "", "responses": ["a", "b"]}, "prompt"),
    ({"prompt": "p", "responses": ["a", "b"]}, "id"),
    ({"id": "x", "prompt": "p", "responses": ["a", "b"], "labels": [{"annotator": "u", "choice": 2}]},
     "choice must be a response index"),
    ({"id": "x", "prompt": "p", "responses": ["a", "b"], "labels": [{"annotator": "u", "choice": True}]},
     "choice must be a response index"),
    ({"id": "x", "prompt": "p", "responses": ["a", "b", "c"],
      "labels": [{"annotator": "u", "ranking": [0, 0, 1]}]}, "ranking must list"),
    ({"id": "x", "prompt": "p", "responses": ["a", "b"],
      "labels": [{"annotator": "u", "choice": 0, "ranking": [0, 1]}]}, "exactly one"),
    ({"id": "x", "prompt": "p", "responses": ["a", "b"],
      "labels": [{"annotator": "u", "choice": 0}, {"annotator": "u", "choice": 1}]}, "twice"),
    ({"id": "x", "prompt": "p", "responses": ["a", "b"], "models": ["m"]}, "one model"),
    ({"id": "x", "prompt": "p", "responses": ["a", "b"], "colour": "red"}, "unknown field"),
])
def test_malformed_items_are_refused_with_the_field_to_fix(record: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as raised:
        parse_comparison(record, "f.jsonl:7")
    assert "f.jsonl:7" in raised.value.message


def test_file_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text(_item(1, [0]).to_json() + "\n{oops\n")
    with pytest.raises(ConfigError, match=r"c.jsonl:2: not valid JSON"):
        read_comparisons(path)
    path.write_text(_item(1, [0]).to_json() + "\n" + _item(1, [1]).to_json() + "\n")
    with pytest.raises(ConfigError, match="already used on line 1"):
        read_comparisons(path)


def test_rankings_become_all_their_pairs_and_choices_beat_every_other() -> None:
    ranked = Comparison("r", "p", ("a", "b", "c"), (Label("u", (2, 0, 1)),))
    assert ranked.preference_pairs() == [(2, 0), (2, 1), (0, 1)]
    voted = Comparison("v", "p", ("a", "b", "c"), (Label("u", (1,)), Label("w", (1,)), Label("z", (0,))))
    assert voted.preference_pairs() == [(1, 0), (1, 2)]
    assert voted.agreement() == pytest.approx(2 / 3)
    tied = Comparison("t", "p", ("a", "b"), (Label("u", (0,)), Label("w", (1,))))
    assert tied.preference_pairs() == [] and tied.agreement() == 0.0


def test_prepare_filters_splits_and_versions(tmp_path: Path) -> None:
    items = [_item(i, [0, 0, 0] if i % 3 else [0, 1, 1]) for i in range(40)]
    items += [_item(40, [0, 1]), _item(41, [1, 1, 1], prompt="prompt 5")]  # a tie; a repeated prompt
    source = tmp_path / "labels.jsonl"
    write_comparisons(source, items)
    result = prepare_comparisons(ComparisonsConfig(str(source), str(tmp_path / "out"), val_fraction=0.3,
                                                   min_agreement=0.7))
    manifest = result.manifest
    dropped = [json.loads(line) for line in (tmp_path / "out" / "dropped.jsonl").read_text().splitlines()]
    assert manifest["dropped"] == {"low_agreement": 14 + 1}  # 14 items at 1/3 agreement, the tie
    assert {d["item"]["id"] for d in dropped} >= {"c40", "c0", "c3"}
    splits = load_comparison_splits(tmp_path / "out")
    assert len(splits.train) + len(splits.val) == 42 - 15 and splits.val
    by_prompt = {}
    for name, part in (("train", splits.train), ("val", splits.val)):
        for item in part:
            by_prompt.setdefault(item.prompt, set()).add(name)
    assert all(len(sides) == 1 for sides in by_prompt.values())
    assert (tmp_path / "out" / "agreement.png").exists()

    # Adding items moves none of the old ones; the same content gives the same version.
    write_comparisons(source, items + [_item(99, [1, 1, 1])])
    again = prepare_comparisons(ComparisonsConfig(str(source), str(tmp_path / "out2"), val_fraction=0.3,
                                                  min_agreement=0.7))
    old_val = {item.id for item in splits.val}
    new_val = {item.id for item in load_comparison_splits(tmp_path / "out2").val}
    assert old_val <= new_val
    write_comparisons(source, items)
    same = prepare_comparisons(ComparisonsConfig(str(source), str(tmp_path / "out3"), val_fraction=0.3,
                                                 min_agreement=0.7))
    assert same.manifest["version"] == manifest["version"] != again.manifest["version"]

    # Flagging keeps low-agreement items, marked.
    flagged = prepare_comparisons(ComparisonsConfig(str(source), str(tmp_path / "out4"), val_fraction=0.3,
                                                    min_agreement=0.7, low_agreement="flag"))
    kept = load_comparison_splits(tmp_path / "out4")
    assert flagged.manifest["dropped"] == {}
    assert sum("flag" in item.meta for item in kept.train + kept.val) == 15

    # A split file edited after the fact is refused.
    with open(tmp_path / "out" / "train.jsonl", "a") as f:
        f.write(_item(77, [0]).to_json() + "\n")
    with pytest.raises(ConfigError, match="differs from manifest.json"):
        load_comparison_splits(tmp_path / "out")


def test_cli_prints_the_splits_and_the_agreement(tmp_path: Path) -> None:
    source = tmp_path / "labels.jsonl"
    write_comparisons(source, [_item(i, [0, 0, 1]) for i in range(12)])
    result = subprocess.run([sys.executable, "-m", "kvik.cli.main", "data", "comparisons", str(source),
                             "--output", str(tmp_path / "out"), "--val-fraction", "0.25"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "train" in result.stdout and "Krippendorff" in result.stdout and "version" in result.stdout
    bad = subprocess.run([sys.executable, "-m", "kvik.cli.main", "data", "comparisons", str(source),
                          "--output", str(tmp_path / "o"), "--val-fraction", "1.5"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "val_fraction" in bad.stderr
