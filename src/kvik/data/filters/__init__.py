"""Quality heuristics, one published rule set per module, each a pure function of one text.

A filter returns `None` to keep the document or a `Rejection` naming the rule that fired and the
measured value, so the dropped-documents file says exactly why.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Rejection:
    rule: str  # e.g. "too_few_words"
    detail: str  # the measured value against the threshold, e.g. "12 < 50"


def ratio_detail(value: float, op: str, threshold: float) -> str:
    return f"{value:.3f} {op} {threshold:g}"
