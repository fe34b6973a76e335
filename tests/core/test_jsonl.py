import pytest

from kvik.core.errors import ConfigError
from kvik.core.jsonl import jsonl_values


def test_values_come_with_their_line_numbers_and_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"a": 1}\n\n   \n[2, 3]\n"text"\n', encoding="utf-8")
    assert list(jsonl_values(path)) == [(1, {"a": 1}), (4, [2, 3]), (5, "text")]


def test_a_line_that_is_not_json_names_the_file_and_line(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_text('{"a": 1}\n{"a": \n', encoding="utf-8")
    values = jsonl_values(path)
    assert next(values) == (1, {"a": 1})  # lines are read one at a time: the first is fine
    with pytest.raises(ConfigError, match=r"b\.jsonl:2: not valid JSON \("):
        next(values)
