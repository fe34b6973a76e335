"""Word splitting without a model: spaced scripts by word, unspaced scripts by character."""

from __future__ import annotations

from kvik.data.normalize import normalize_text
from kvik.data.config import NormalizeConfig
from kvik.data.words import count_sentences, split_words


def test_words_in_spaced_scripts() -> None:
    assert split_words("Don't stop: l'état, co-op -- 42 times!") == ["Don't", "stop", "l'état", "co-op",
                                                                   "42", "times"]
    assert split_words("Привет, мир! हिन्दी भाषा 안녕하세요 세계") == ["Привет", "мир", "हिन्दी", "भाषा",
                                                           "안녕하세요", "세계"]


def test_unspaced_scripts_count_characters_with_their_marks() -> None:
    assert split_words("東京は大きい") == ["東", "京", "は", "大", "き", "い"]
    assert split_words("สวัสดี") == ["ส", "วั", "ส", "ดี"]


def test_sentences_across_scripts() -> None:
    assert count_sentences("One. Two! Three? 四。 Five؟ and a half") == 5


def test_normalisation() -> None:
    config = NormalizeConfig(strip_markdown=True)
    raw = ("## SCENE I.\r\n\r\n\r\n**HAMLET**  \n\\[Aside] To be, or _not_ to be\u200b:  \n"
           "\x07keep snake_case")
    assert normalize_text(raw, config) == ("SCENE I.\n\nHAMLET\n[Aside] To be, or not to be:\n"
                                           "keep snake_case")
    assert normalize_text("e\u0301", NormalizeConfig()) == "\u00e9"  # NFC composes
