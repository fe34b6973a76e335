"""The run report: documents per stage and per drop reason, as JSON, text and a PNG chart.

Everything in it is a function of the inputs and the config (no timings, no dates, no absolute
temporary paths), so the same run writes the same bytes; timings go to the terminal only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvik.data.document import Dropped


@dataclass(slots=True)
class PipelineCounts:
    stages: tuple[str, ...]
    input_documents: int = 0
    dropped_by_reason: dict[str, int] = field(default_factory=dict)
    edits: dict[str, int] = field(default_factory=dict)

    def add_dropped(self, dropped: Dropped) -> None:
        self.dropped_by_reason[dropped.reason] = self.dropped_by_reason.get(dropped.reason, 0) + 1

    def add_edits(self, edits: dict[str, int]) -> None:
        for key, amount in edits.items():
            self.edits[key] = self.edits.get(key, 0) + amount

    def dropped_by_stage(self) -> dict[str, int]:
        per_stage = {stage: 0 for stage in self.stages}
        for reason, count in self.dropped_by_reason.items():
            per_stage[reason.split("/", 1)[0]] += count
        return per_stage

    @property
    def output_documents(self) -> int:
        return self.input_documents - sum(self.dropped_by_reason.values())


def build_report(counts: PipelineCounts, tokens: dict[str, Any] | None,
                 dataset_version: str | None) -> dict[str, Any]:
    remaining = counts.input_documents
    stages = []
    for stage, dropped in counts.dropped_by_stage().items():
        remaining -= dropped
        stages.append({"stage": stage, "dropped": dropped, "remaining": remaining})
    return {
        "input_documents": counts.input_documents,
        "output_documents": counts.output_documents,
        "stages": stages,
        "dropped_by_reason": dict(sorted(counts.dropped_by_reason.items())),
        "edits": dict(sorted(counts.edits.items())),
        "tokens": tokens,
        "dataset_version": dataset_version,
    }


def report_text(report: dict[str, Any]) -> str:
    lines = [f"input documents   {report['input_documents']:>10,}",
             f"output documents  {report['output_documents']:>10,}", "",
             f"{'stage':<20}{'dropped':>10}{'remaining':>12}"]
    lines += [f"{s['stage']:<20}{s['dropped']:>10,}{s['remaining']:>12,}" for s in report["stages"]]
    lines += ["", f"{'drop reason':<44}{'documents':>10}"]
    lines += [f"{reason:<44}{count:>10,}" for reason, count in report["dropped_by_reason"].items()]
    if report["edits"]:
        lines += ["", f"{'edit (document kept)':<44}{'count':>10}"]
        lines += [f"{key:<44}{count:>10,}" for key, count in report["edits"].items()]
    if report["tokens"]:
        lines += ["", f"{'split':<20}{'documents':>10}{'tokens':>14}"]
        lines += [f"{split:<20}{info['documents']:>10,}{info['tokens']:>14,}"
                  for split, info in report["tokens"].items()]
    if report["dataset_version"]:
        lines += ["", f"dataset version {report['dataset_version']}"]
    return "\n".join(lines) + "\n"


def write_chart(report: dict[str, Any], path: Path) -> None:
    """Two panels: documents left after each stage, and documents dropped per reason."""
    import matplotlib

    matplotlib.use("Agg")  # no display; also the only backend whose PNG bytes are reproducible
    import matplotlib.pyplot as plt

    reasons = report["dropped_by_reason"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, max(3.5, 0.3 * len(reasons) + 1.5)))
    stages = ["input"] + [s["stage"] for s in report["stages"]]
    remaining = [report["input_documents"]] + [s["remaining"] for s in report["stages"]]
    left.barh(stages[::-1], remaining[::-1], color="#4c72b0")
    left.set_title("documents remaining after each stage")
    right.barh(list(reasons)[::-1] or ["(none)"], list(reasons.values())[::-1] or [0], color="#dd8452")
    right.set_title("documents dropped per reason")
    for axis in (left, right):
        axis.tick_params(labelsize=8)
    fig.tight_layout()
    # No "Software" entry: the PNG's bytes then depend only on the drawing.
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def write_report(report: dict[str, Any], out_dir: Path) -> None:
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "report.txt").write_text(report_text(report))
    write_chart(report, out_dir / "report.png")
