"""Each published rule drops the hand-written document that breaks it, with that rule as the reason;
clean prose passes every rule; the pipeline's dropped file and report agree."""

from __future__ import annotations

import pytest
from tests.data.helpers import CLEAN_TEXTS, only_stages, read_jsonl, write_jsonl

from kvik.data.config import (C4Config, FineWebConfig, GopherQualityConfig, GopherRepetitionConfig,
                              pipeline_config_from_dict)
from kvik.data.filters import c4, fineweb, gopher_quality, gopher_repetition
from kvik.data.pipeline import run_pipeline

CLEAN = CLEAN_TEXTS[0]
LINES = CLEAN.split("\n")
DISTINCT_WORDS = ("apple banana cherry damson elder fig grape hazel iris juniper kale lemon mango "
                  "nutmeg olive pepper quince radish sage thyme").split()


@pytest.mark.parametrize("text", CLEAN_TEXTS)
def test_clean_prose_passes_every_rule(text: str) -> None:
    assert gopher_quality.check(text, GopherQualityConfig()) is None
    assert gopher_repetition.check(text, GopherRepetitionConfig()) is None
    outcome = c4.check(text, C4Config())
    assert outcome.rejection is None and outcome.text == text and outcome.lines_removed == 0
    assert fineweb.check(text, FineWebConfig()) is None


GOPHER_QUALITY_CASES = {
    "too_few_words": ("The cat sat on the mat and that was the end of it.", {}),
    "too_many_words": (CLEAN, {"max_words": 100}),
    "short_mean_word_length": (" ".join(["to be or it is a go at me"] * 8), {}),
    "long_mean_word_length": (" ".join(["the incomprehensibilities of internationalization"] * 20), {}),
    "symbol_word_ratio": (CLEAN + "\n" + " ".join(f"#{w}" for w in DISTINCT_WORDS), {}),
    "bullet_lines_ratio": ("\n".join(f"- {line}" for line in LINES), {}),
    "ellipsis_lines_ratio": ("\n".join(line[:-1] + "..." for line in LINES), {}),
    "alpha_words_ratio": (CLEAN + "\n" + " ".join(str(1000 + 7 * i) for i in range(400)), {}),
    "too_few_stop_words": (
        "Bright morning light fills every quiet room. Small birds sing outside my window.\n"
        "Coffee brews slowly in a copper pot. Neighbors wave from across this street.\n"
        "Old dogs sleep near warm stoves. Students hurry toward distant classrooms.\n"
        "Rain clouds gather above green hills. Farmers inspect young corn plants.\n"
        "Trains rumble past empty platforms. Sailors mend torn canvas sails.", {}),
}


@pytest.mark.parametrize("rule", sorted(GOPHER_QUALITY_CASES))
def test_gopher_quality_rule(rule: str) -> None:
    text, settings = GOPHER_QUALITY_CASES[rule]
    rejection = gopher_quality.check(text, GopherQualityConfig(**settings))
    assert rejection is not None and rejection.rule == rule, rejection


GOPHER_REPETITION_CASES = {
    "duplicate_paragraphs": ("\n\n".join([LINES[0], LINES[1], LINES[2], LINES[1], LINES[2]])),
    "duplicate_lines": ("\n".join(LINES + [LINES[3]] * 4)),
    "top_2gram_chars": (" ".join(f"{w} of the" for w in DISTINCT_WORDS) + "."),
    "duplicate_5gram_chars": (CLEAN + "\nAnd again: " + LINES[0] + " Once more: " + LINES[4]),
}


@pytest.mark.parametrize("rule", sorted(GOPHER_REPETITION_CASES))
def test_gopher_repetition_rule(rule: str) -> None:
    rejection = gopher_repetition.check(GOPHER_REPETITION_CASES[rule], GopherRepetitionConfig())
    assert rejection is not None and rejection.rule == rule, rejection


def test_c4_line_rules_remove_lines_and_keep_the_document() -> None:
    text = "\n".join([LINES[0], "Please enable JavaScript to view this page.", LINES[1],
                      "Read our privacy policy before you continue.", "Home", LINES[2],
                      "A line without an ending", *LINES[3:]])
    outcome = c4.check(text, C4Config())
    assert outcome.rejection is None
    assert outcome.text == CLEAN
    assert outcome.lines_removed == 4


@pytest.mark.parametrize("rule, text", [
    ("lorem_ipsum", CLEAN + "\nLorem ipsum dolor sit amet, consectetur adipiscing elit."),
    ("curly_bracket", CLEAN + "\nThe config was {\"debug\": true} in the end."),
    ("too_few_sentences", "\n".join(LINES[:3])),
    ("no_lines_left", "\n".join(line[:-1] for line in LINES)),
])
def test_c4_document_rule(rule: str, text: str) -> None:
    rejection = c4.check(text, C4Config()).rejection
    assert rejection is not None and rejection.rule == rule, rejection


FINEWEB_CASES = {
    "line_punct_ratio": "\n".join(line[:-1] for line in LINES),
    "short_line_ratio": "\n".join(f"The {w} grew near the wall." for w in DISTINCT_WORDS),
    "duplicate_line_chars": "\n".join(LINES[:3] + ["It was very cold."] + LINES[3:] + ["It was very cold."]),
    "newline_word_ratio": "\n".join(f"Extraordinarily magnificent {w}celebrations." for w in DISTINCT_WORDS),
}


@pytest.mark.parametrize("rule", sorted(FINEWEB_CASES))
def test_fineweb_rule(rule: str) -> None:
    rejection = fineweb.check(FINEWEB_CASES[rule], FineWebConfig())
    assert rejection is not None and rejection.rule == rule, rejection


def test_thresholds_come_from_the_config() -> None:
    text = GOPHER_QUALITY_CASES["too_few_words"][0]
    assert gopher_quality.check(text, GopherQualityConfig(min_words=5, min_mean_word_length=2.5)) is None
    assert gopher_quality.check(text, GopherQualityConfig(min_words=None, min_mean_word_length=None)) is None
    assert fineweb.check(FINEWEB_CASES["duplicate_line_chars"],
                         FineWebConfig(max_duplicate_line_chars_ratio=0.5)) is None


def test_pipeline_drops_each_document_with_its_reason_and_reports_the_counts(tmp_path) -> None:
    docs = [("clean-0", CLEAN_TEXTS[0]), ("clean-1", CLEAN_TEXTS[1]),
            ("short", GOPHER_QUALITY_CASES["too_few_words"][0]),
            ("bullets", GOPHER_QUALITY_CASES["bullet_lines_ratio"][0]),
            ("stopwords", GOPHER_QUALITY_CASES["too_few_stop_words"][0]),
            ("repeated-lines", GOPHER_REPETITION_CASES["duplicate_lines"]),
            ("lorem", CLEAN + "\nLorem ipsum dolor sit amet, consectetur adipiscing elit."),
            ("no-punct", FINEWEB_CASES["line_punct_ratio"]),
            ("dup-line", FINEWEB_CASES["duplicate_line_chars"]),
            ("empty", " \n\t\n ")]
    expected = {"short": "gopher_quality/too_few_words", "bullets": "gopher_quality/bullet_lines_ratio",
                "stopwords": "gopher_quality/too_few_stop_words",
                "repeated-lines": "gopher_repetition/duplicate_lines", "lorem": "c4/lorem_ipsum",
                # C4's line rule removes every line without punctuation first.
                "no-punct": "c4/no_lines_left", "dup-line": "fineweb/duplicate_line_chars",
                "empty": "normalize/empty"}
    inputs = write_jsonl(tmp_path / "in.jsonl", docs)
    sections = {name: {"enabled": True} for name in ("gopher_quality", "gopher_repetition", "c4",
                                                     "fineweb")}
    config = pipeline_config_from_dict(only_stages(inputs, tmp_path / "out", **sections))
    result = run_pipeline(config, tokenize=False, progress=False)

    dropped = {d["id"]: d for d in read_jsonl(tmp_path / "out" / "dropped.jsonl")}
    assert {i: d["reason"] for i, d in dropped.items()} == expected
    assert dropped["short"]["text"] == docs[2][1] and dropped["short"]["detail"]
    kept = read_jsonl(tmp_path / "out" / "documents.jsonl")
    assert [d["id"] for d in kept] == ["clean-0", "clean-1"]

    report = result.report
    assert report["input_documents"] == 10 and report["output_documents"] == 2
    assert report["dropped_by_reason"] == {r: 1 for r in expected.values()}
    per_stage = {s["stage"]: s["dropped"] for s in report["stages"]}
    assert per_stage == {"normalize": 1, "gopher_repetition": 1, "gopher_quality": 3, "c4": 2,
                         "fineweb": 1, "pii": 0, "exact_dedup": 0, "near_dedup": 0}
    text_report = (tmp_path / "out" / "report.txt").read_text()
    assert "gopher_quality/bullet_lines_ratio" in text_report
    assert (tmp_path / "out" / "report.png").read_bytes().startswith(b"\x89PNG")
