"""Inter-annotator agreement on comparisons: how much the labels can be trusted.

The category of a label is the response the annotator put first (its index). With A annotators and
N items the labels form an A x N table with holes where an annotator skipped an item.

- Cohen's kappa for every pair of annotators, over the items both labelled:
  (p_o - p_e) / (1 - p_e), chance agreement p_e from each annotator's own category frequencies.
- Fleiss' kappa for the whole set, over items with two or more labels. With the same number of
  labels on every item it is Fleiss (1971); with varying numbers each item's agreement uses its own
  count n_i and the category proportions weigh items by n_i (the usual generalisation).
- Krippendorff's alpha (nominal), which is built for missing labels: 1 - D_o / D_e from the
  coincidence matrix of values paired within each item (items with one label pair nothing).
- Per annotator: agreement with the majority of the *other* annotators on the items where they
  have a strict majority (leaving the annotator out keeps them from agreeing with themselves).
- A confusion table: each label against that leave-one-out majority, pooled over annotators.

Undefined statistics (every label the same category, so chance agreement is certain) are NaN, as
scikit-learn's `cohen_kappa_score` returns; the report prints them as "undefined".

These formulas are short and pinned by tests against scikit-learn and the `krippendorff`
package; those libraries are not runtime dependencies because they cover none of the rest
(missing-label pairing, leave-one-out majorities, the report).
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from kvik.core.comparisons import Comparison

Table = list[list[int | None]]  # [annotator][item] -> category or None (missing)


@dataclass(slots=True)
class PairAgreement:
    annotators: tuple[str, str]
    items: int  # labelled by both
    observed: float  # fraction of those items with the same choice
    kappa: float
    confusion: dict[str, dict[str, int]]  # first annotator's choice -> second's -> items


@dataclass(slots=True)
class AgreementReport:
    items: int
    annotators: list[str]
    labels: int
    categories: list[int]
    fleiss_kappa: float
    fleiss_items: int  # items with two or more labels
    krippendorff_alpha: float
    pairs: list[PairAgreement] = field(default_factory=list)
    with_majority: dict[str, float | None] = field(default_factory=dict)
    confusion: dict[str, dict[str, int]] = field(default_factory=dict)  # label -> majority -> count
    item_agreement: dict[str, int] = field(default_factory=dict)  # histogram, e.g. "0.67" -> 12

    def to_dict(self) -> dict[str, Any]:
        def number(x: float | None) -> float | None:
            return None if x is None or math.isnan(x) else round(x, 6)

        return {
            "items": self.items, "annotators": self.annotators, "labels": self.labels,
            "categories": self.categories, "fleiss_kappa": number(self.fleiss_kappa),
            "fleiss_items": self.fleiss_items, "krippendorff_alpha": number(self.krippendorff_alpha),
            "cohen_kappa": [{"annotators": list(p.annotators), "items": p.items,
                             "observed_agreement": number(p.observed), "kappa": number(p.kappa),
                             "confusion": p.confusion} for p in self.pairs],
            "agreement_with_majority": {a: number(v) for a, v in self.with_majority.items()},
            "confusion_vs_majority": self.confusion,
            "item_agreement_histogram": self.item_agreement,
        }


def label_table(items: Sequence[Comparison]) -> tuple[list[str], Table]:
    """Annotators (sorted) and their first choices per item (None where they gave no label)."""
    annotators = sorted({label.annotator for item in items for label in item.labels})
    row_of = {a: i for i, a in enumerate(annotators)}
    table: Table = [[None] * len(items) for _ in annotators]
    for column, item in enumerate(items):
        for label in item.labels:
            table[row_of[label.annotator]][column] = label.choice
    return annotators, table


def cohen_kappa(first: Sequence[int], second: Sequence[int]) -> float:
    """Cohen's kappa of two equally long label lists (no missing values)."""
    n = len(first)
    if n == 0:
        return math.nan
    observed = sum(a == b for a, b in zip(first, second)) / n
    count_a, count_b = Counter(first), Counter(second)
    expected = sum(count_a[c] * count_b[c] for c in count_a) / (n * n)
    if expected == 1.0:
        return math.nan
    return (observed - expected) / (1 - expected)


def fleiss_kappa(table: Table) -> tuple[float, int]:
    """(kappa, items used): items need two or more labels."""
    per_item: list[Counter] = []
    for column in range(len(table[0]) if table else 0):
        values = [row[column] for row in table if row[column] is not None]
        if len(values) >= 2:
            per_item.append(Counter(values))
    if not per_item:
        return math.nan, 0
    agreement = []
    totals: Counter = Counter()
    for counts in per_item:
        n = sum(counts.values())
        agreement.append((sum(c * c for c in counts.values()) - n) / (n * (n - 1)))
        totals.update(counts)
    all_labels = sum(totals.values())
    p_observed = sum(agreement) / len(agreement)
    p_expected = sum((c / all_labels) ** 2 for c in totals.values())
    if p_expected == 1.0:
        return math.nan, len(per_item)
    return (p_observed - p_expected) / (1 - p_expected), len(per_item)


def krippendorff_alpha_nominal(table: Table) -> float:
    """Krippendorff's alpha for nominal data with missing values (None)."""
    coincidence: Counter = Counter()  # (c, k) -> o_ck
    for column in range(len(table[0]) if table else 0):
        values = [row[column] for row in table if row[column] is not None]
        m = len(values)
        if m < 2:
            continue
        counts = Counter(values)
        for c, k in itertools.product(counts, repeat=2):
            pairs = counts[c] * (counts[k] - (1 if c == k else 0))
            if pairs:
                coincidence[c, k] += pairs / (m - 1)
    marginals: Counter = Counter()
    for (c, _), value in coincidence.items():
        marginals[c] += value
    n = sum(marginals.values())
    disagreement_observed = sum(v for (c, k), v in coincidence.items() if c != k)
    disagreement_expected = sum(marginals[c] * marginals[k]
                                for c, k in itertools.permutations(marginals, 2))
    if n == 0 or disagreement_expected == 0:
        return math.nan
    return 1.0 - (n - 1) * disagreement_observed / disagreement_expected


def _majority(values: Sequence[int]) -> int | None:
    counts = Counter(values).most_common()
    if not counts or (len(counts) > 1 and counts[0][1] == counts[1][1]):
        return None
    return counts[0][0]


def measure_agreement(items: Sequence[Comparison]) -> AgreementReport:
    annotators, table = label_table(items)
    categories = sorted({v for row in table for v in row if v is not None})
    fleiss, fleiss_items = fleiss_kappa(table)
    report = AgreementReport(items=len(items), annotators=annotators,
                             labels=sum(v is not None for row in table for v in row),
                             categories=categories, fleiss_kappa=fleiss, fleiss_items=fleiss_items,
                             krippendorff_alpha=krippendorff_alpha_nominal(table))
    for i, j in itertools.combinations(range(len(annotators)), 2):
        both = [(a, b) for a, b in zip(table[i], table[j]) if a is not None and b is not None]
        confusion: dict[str, dict[str, int]] = {}
        for a, b in both:
            row = confusion.setdefault(str(a), {})
            row[str(b)] = row.get(str(b), 0) + 1
        first, second = [a for a, _ in both], [b for _, b in both]
        report.pairs.append(PairAgreement(
            (annotators[i], annotators[j]), len(both),
            sum(a == b for a, b in both) / len(both) if both else math.nan,
            cohen_kappa(first, second), confusion))
    for row_index, annotator in enumerate(annotators):
        agree = total = 0
        for column, value in enumerate(table[row_index]):
            if value is None:
                continue
            others = [row[column] for r, row in enumerate(table)
                      if r != row_index and row[column] is not None]
            majority = _majority(others)
            if majority is None:
                continue
            total += 1
            agree += value == majority
            row = report.confusion.setdefault(str(value), {})
            row[str(majority)] = row.get(str(majority), 0) + 1
        report.with_majority[annotator] = agree / total if total else None
    histogram: Counter = Counter(f"{item.agreement():.2f}" for item in items if item.labels)
    report.item_agreement = dict(sorted(histogram.items()))
    return report


def _fmt(value: float | None) -> str:
    return "undefined" if value is None or math.isnan(value) else f"{value:.3f}"


def report_text(report: AgreementReport) -> str:
    lines = [f"items {report.items}, annotators {len(report.annotators)}, labels {report.labels}",
             f"Fleiss' kappa          {_fmt(report.fleiss_kappa)}  ({report.fleiss_items} items "
             "with 2+ labels)",
             f"Krippendorff's alpha   {_fmt(report.krippendorff_alpha)}  (nominal)", "",
             f"{'annotator pair':<36}{'items':>7}{'agree':>8}{'kappa':>11}"]
    lines += [f"{' / '.join(p.annotators):<36}{p.items:>7}{_fmt(p.observed):>8}{_fmt(p.kappa):>11}"
              for p in report.pairs]
    lines += ["", f"{'annotator':<28}{'agreement with majority of others':>34}"]
    lines += [f"{a:<28}{_fmt(v):>34}" for a, v in report.with_majority.items()]
    if report.confusion:
        columns = [str(c) for c in report.categories]
        lines += ["", "confusion: label (rows) against the others' majority (columns), by response index",
                  "      " + "".join(f"{c:>8}" for c in columns)]
        lines += [f"{r:>6}" + "".join(f"{report.confusion.get(r, {}).get(c, 0):>8}" for c in columns)
                  for r in columns]
    return "\n".join(lines) + "\n"


def write_chart(report: AgreementReport, path: Path) -> None:
    """Left: Cohen's kappa of every annotator pair as a matrix; right: agreement with the majority."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = report.annotators
    matrix = np.full((len(names), len(names)), np.nan)
    for pair in report.pairs:
        i, j = names.index(pair.annotators[0]), names.index(pair.annotators[1])
        matrix[i, j] = matrix[j, i] = pair.kappa
    np.fill_diagonal(matrix, 1.0)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, max(4.0, 0.35 * len(names) + 2)))
    image = left.imshow(matrix, vmin=-1, vmax=1, cmap="RdBu")
    left.set_xticks(range(len(names)), names, rotation=90, fontsize=8)
    left.set_yticks(range(len(names)), names, fontsize=8)
    left.set_title(f"Cohen's kappa per pair (Fleiss {_fmt(report.fleiss_kappa)}, "
                   f"alpha {_fmt(report.krippendorff_alpha)})", fontsize=9)
    fig.colorbar(image, ax=left, fraction=0.046)
    values = [v if v is not None else 0.0 for v in report.with_majority.values()]
    right.barh(list(report.with_majority)[::-1], values[::-1], color="#4c72b0")
    right.set_xlim(0, 1)
    right.set_title("agreement with the majority of the other annotators", fontsize=9)
    right.tick_params(labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def write_agreement_report(report: AgreementReport, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "agreement.json", out_dir / "agreement.txt", out_dir / "agreement.png"]
    paths[0].write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    paths[1].write_text(report_text(report))
    write_chart(report, paths[2])
    return paths
