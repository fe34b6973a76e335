"""Normalisation: one canonical form per text, so exact dedup and the filters see what a reader sees.

Unicode normal form, one newline convention, no control characters, no trailing spaces, bounded
runs of blank lines; optionally Markdown headings, emphasis and escapes reduced to plain text.
"""

from __future__ import annotations

import re
import unicodedata

from kvik.data.config import NormalizeConfig

# C0/C1 controls except tab and newline, plus zero-width and BOM characters that survive NFC.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b\u200e\u200f\u2028\u2029\ufeff]")
_HEADING = re.compile(r"^#{1,6}\s+", re.MULTILINE)
_BOLD = re.compile(r"\*\*(.+?)\*\*")
# _emphasis_ only at word boundaries, so snake_case_names survive.
_ITALIC = re.compile(r"(?<!\w)_(\S(?:.*?\S)?)_(?!\w)", re.DOTALL)
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!|])")  # Markdown's backslash escapes: \[Aside] -> [Aside]


def normalize_text(text: str, config: NormalizeConfig) -> str:
    if config.unicode_form:
        text = unicodedata.normalize(config.unicode_form, text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub("", text)
    if config.strip_markdown:
        text = _HEADING.sub("", text)
        text = _BOLD.sub(r"\1", text)
        text = _ITALIC.sub(r"\1", text)
        text = _ESCAPE.sub(r"\1", text)
    lines = [line.rstrip() for line in text.split("\n")]
    out: list[str] = []
    blank_run = 0
    for line in lines:
        blank_run = blank_run + 1 if not line else 0
        if blank_run <= config.max_blank_lines:
            out.append(line)
    return "\n".join(out).strip("\n")
