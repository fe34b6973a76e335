"""Agreement statistics against independent implementations: scikit-learn's cohen_kappa_score,
the `krippendorff` package (nominal alpha, missing values as NaN) and statsmodels' fleiss_kappa,
on random label sets and adversarial ones (all agree, all disagree, one category, missing labels)."""

from __future__ import annotations

import itertools
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvik.core.comparisons import Comparison, Label, write_comparisons
from kvik.data.agreement import (cohen_kappa, fleiss_kappa, krippendorff_alpha_nominal,
                                 measure_agreement)

krippendorff = pytest.importorskip("krippendorff")
sklearn_metrics = pytest.importorskip("sklearn.metrics")
inter_rater = pytest.importorskip("statsmodels.stats.inter_rater")


def _random_table(seed: int, annotators: int, items: int, categories: int, missing: float,
                  agreement: float) -> list[list[int | None]]:
    """Labels that follow a hidden truth with probability `agreement`, with holes."""
    rng = random.Random(seed)
    truth = [rng.randrange(categories) for _ in range(items)]
    return [[None if rng.random() < missing else
             (truth[i] if rng.random() < agreement else rng.randrange(categories))
             for i in range(items)] for _ in range(annotators)]


ADVERSARIAL = {
    "all_agree_varied": [[0, 1, 2, 1, 0, 2]] * 3,
    "all_disagree": [[0, 1, 2, 0, 1, 2], [1, 2, 0, 1, 2, 0], [2, 0, 1, 2, 0, 1]],
    "systematic_flip": [[0, 1, 0, 1, 0, 1], [1, 0, 1, 0, 1, 0]],
    "one_category": [[1, 1, 1, 1], [1, 1, 1, 1]],
    "missing_labels": [[0, None, 1, 1, None, 0, 2], [0, 1, None, 1, 2, None, 2],
                       [None, 1, 1, 0, 2, 0, None]],
}
RANDOM = {f"random_{seed}": _random_table(seed, annotators=4, items=60, categories=2 + seed % 3,
                                          missing=0.25 * (seed % 2), agreement=0.2 + 0.15 * seed)
          for seed in range(5)}
TABLES = {**ADVERSARIAL, **RANDOM}


class _quiet:
    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def _same(ours: float, reference: float) -> bool:
    return (math.isnan(ours) and math.isnan(reference)) or ours == pytest.approx(reference, abs=1e-9)


@pytest.mark.parametrize("name", sorted(TABLES))
def test_cohen_kappa_equals_scikit_learn(name: str) -> None:
    table = TABLES[name]
    for first, second in itertools.combinations(table, 2):
        both = [(a, b) for a, b in zip(first, second) if a is not None and b is not None]
        a, b = [x for x, _ in both], [y for _, y in both]
        with _quiet():
            expected = sklearn_metrics.cohen_kappa_score(a, b)
        assert _same(cohen_kappa(a, b), float(expected)), (name, a, b)


@pytest.mark.parametrize("name", sorted(TABLES))
def test_krippendorff_alpha_equals_the_krippendorff_package(name: str) -> None:
    table = TABLES[name]
    data = np.array([[np.nan if v is None else v for v in row] for row in table], dtype=float)
    try:
        expected = krippendorff.alpha(reliability_data=data, level_of_measurement="nominal")
    except ValueError:  # the package refuses a single category: alpha is undefined
        expected = math.nan
    assert _same(krippendorff_alpha_nominal(table), float(expected)), name


@pytest.mark.parametrize("name", sorted(n for n, t in TABLES.items()
                                        if all(v is not None for row in t for v in row)))
def test_fleiss_kappa_equals_statsmodels_on_complete_tables(name: str) -> None:
    table = TABLES[name]
    counts, _ = inter_rater.aggregate_raters(np.array(table).T)
    with _quiet():
        expected = inter_rater.fleiss_kappa(counts, method="fleiss")
    ours, used = fleiss_kappa(table)
    assert used == len(table[0])
    assert _same(ours, float(expected)), name


def test_fleiss_kappa_with_missing_labels_weighs_each_item_by_its_own_count() -> None:
    """Items with different numbers of labels: the per-item generalisation, computed by hand."""
    table = [[0, 0, 1], [0, 1, None], [0, None, None]]  # rows: annotators; columns: items
    # item 0: labels 0, 0, 0 -> P=1; item 1: labels 0, 1 -> P=0; item 2: one label -> unused.
    # category proportions over the 5 used labels: 0 -> 4/5, 1 -> 1/5; Pe = 0.68.
    kappa, used = fleiss_kappa(table)
    assert used == 2
    assert kappa == pytest.approx((0.5 - 0.68) / (1 - 0.68))


def _items_from(table: list[list[int | None]]) -> list[Comparison]:
    items = []
    for column in range(len(table[0])):
        labels = tuple(Label(f"ann{row}", (table[row][column],)) for row in range(len(table))
                       if table[row][column] is not None)
        items.append(Comparison(f"c{column}", f"prompt {column}", ("a", "b", "c"), labels))
    return items


def test_report_matches_the_references_and_leaves_each_annotator_out_of_its_majority() -> None:
    table = RANDOM["random_3"]
    report = measure_agreement(_items_from(table))
    data = np.array([[np.nan if v is None else v for v in row] for row in table], dtype=float)
    assert report.krippendorff_alpha == pytest.approx(
        krippendorff.alpha(reliability_data=data, level_of_measurement="nominal"))
    assert len(report.pairs) == 6
    # Annotator 0 against the majority of annotators 1-3, by hand.
    agree = total = 0
    for column in range(len(table[0])):
        if table[0][column] is None:
            continue
        others = [table[r][column] for r in (1, 2, 3) if table[r][column] is not None]
        counts = sorted(((others.count(v), v) for v in set(others)), reverse=True)
        if not counts or (len(counts) > 1 and counts[0][0] == counts[1][0]):
            continue
        total += 1
        agree += table[0][column] == counts[0][1]
    assert report.with_majority["ann0"] == pytest.approx(agree / total)
    # The confusion table holds every label whose item has a leave-one-out majority, once.
    assert sum(sum(row.values()) for row in report.confusion.values()) == _labels_with_majority(table)


def _labels_with_majority(table: list[list[int | None]]) -> int:
    count = 0
    for r, row in enumerate(table):
        for column, value in enumerate(row):
            if value is None:
                continue
            others = [table[o][column] for o in range(len(table)) if o != r and table[o][column] is not None]
            counts = sorted((others.count(v) for v in set(others)), reverse=True)
            if counts and (len(counts) == 1 or counts[0] > counts[1]):
                count += 1
    return count


def test_kvik_data_agreement_writes_text_json_and_chart(tmp_path: Path) -> None:
    source = tmp_path / "labels.jsonl"
    write_comparisons(source, _items_from(ADVERSARIAL["missing_labels"]))
    result = subprocess.run([sys.executable, "-m", "kvik.cli.main", "data", "agreement", str(source),
                             "--output", str(tmp_path / "report")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Krippendorff's alpha" in result.stdout and "Fleiss' kappa" in result.stdout
    report = json.loads((tmp_path / "report" / "agreement.json").read_text())
    assert {p["annotators"][0] + "/" + p["annotators"][1] for p in report["cohen_kappa"]} == {
        "ann0/ann1", "ann0/ann2", "ann1/ann2"}
    png = (tmp_path / "report" / "agreement.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000
