"""Token shards: documents tokenized, joined with end-of-text tokens and packed into binary files.

The on-disk format is defined in `kvik.core.shard_format`, which `kvik.train.shards` reads with.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvik.core.config_files import file_sha256
from kvik.core.errors import ConfigError
from kvik.core.shard_format import MANIFEST_FORMAT, content_version, shard_file_name, token_dtype_name
from kvik.core.tokenizer_files import train_tokenizer, write_tokenizer
from kvik.data.config import ShardConfig, TokenizerConfig

DEFAULT_EOS_TOKEN = "<|endoftext|>"  # what kvik's own tokenizers end documents with
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
ENCODE_BATCH = 256  # documents per call into the (multi-threaded) Rust tokenizer


def prepare_tokenizer(config: TokenizerConfig, texts: Iterable[str], out_dir: Path) -> Any:
    """Copy the configured tokenizer into `out_dir`, or train a byte-level BPE on `texts`."""
    from tokenizers import Tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    if config.path:
        source = Path(config.path)
        for name in TOKENIZER_FILES:
            if not (source / name).is_file():
                raise ConfigError(f"tokenizer.path: {source} has no {name}")
            shutil.copyfile(source / name, out_dir / name)
        return Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    tokenizer = train_tokenizer(config.vocab_size, list(texts))
    write_tokenizer(out_dir, tokenizer, config.model_max_length)
    return tokenizer


def eos_token_id(tokenizer_dir: Path, tokenizer: Any) -> int:
    """The id that separates documents: the tokenizer's declared end-of-sequence token."""
    settings = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    token = settings.get("eos_token") or DEFAULT_EOS_TOKEN
    if isinstance(token, dict):  # older files store the AddedToken's fields
        token = token["content"]
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ConfigError(f"tokenizer: {tokenizer_dir} declares eos_token {token!r}, which is not in "
                          "its vocabulary; documents need it as a separator")
    return token_id


def choose_validation(num_documents: int, config: ShardConfig) -> set[int]:
    """Indices of the documents held out for validation: a seeded sample, at least one if asked."""
    if config.val_fraction <= 0 or num_documents < 2:
        return set()
    count = max(1, round(num_documents * config.val_fraction))
    return set(random.Random(config.seed).sample(range(num_documents), count))


@dataclass(slots=True)
class _SplitWriter:
    """Writes one split's shards, starting a new file when the next document would not fit."""

    name: str
    out_dir: Path
    dtype: np.dtype
    shard_tokens: int
    shards: list[dict[str, Any]] = field(default_factory=list)
    _buffer: list[np.ndarray] = field(default_factory=list)
    _buffered: int = 0
    _documents: int = 0

    def add(self, ids: np.ndarray) -> None:
        if self._buffered and self._buffered + len(ids) > self.shard_tokens:
            self.flush()
        self._buffer.append(ids)
        self._buffered += len(ids)
        self._documents += 1

    def flush(self) -> None:
        if not self._buffer:
            return
        path = self.out_dir / shard_file_name(self.name, len(self.shards))
        np.concatenate(self._buffer).astype(self.dtype.newbyteorder("<")).tofile(path)
        self.shards.append({"file": path.name, "documents": self._documents,
                            "tokens": self._buffered, "sha256": file_sha256(path)})
        self._buffer, self._buffered, self._documents = [], 0, 0

    def summary(self) -> dict[str, Any]:
        return {"documents": sum(s["documents"] for s in self.shards),
                "tokens": sum(s["tokens"] for s in self.shards), "shards": self.shards}


def _batches(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def write_shards(texts: Iterable[str], num_documents: int, tokenizer: Any, eos: int, out_dir: Path,
                 config: ShardConfig) -> dict[str, dict[str, Any]]:
    """Tokenize `texts` (in order), each followed by `eos`, into train/val shards under `out_dir`;
    return the split summaries."""
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(token_dtype_name(vocab_size))
    val = choose_validation(num_documents, config)
    writers = {name: _SplitWriter(name, out_dir, dtype, config.shard_tokens) for name in ("train", "val")}
    index = 0
    for batch in _batches(texts, ENCODE_BATCH):
        for encoding in tokenizer.encode_batch(batch, add_special_tokens=False):
            writers["val" if index in val else "train"].add(np.array([*encoding.ids, eos], dtype=dtype))
            index += 1
    for writer in writers.values():
        writer.flush()
    return {name: writer.summary() for name, writer in writers.items()}


def write_manifest(out_dir: Path, tokenizer_dir: Path, tokenizer: Any, eos: int,
                   splits: dict[str, dict[str, Any]], config: dict[str, Any],
                   input_documents: int) -> dict[str, Any]:
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer_info = {
        "dir": tokenizer_dir.relative_to(out_dir).as_posix(),
        "sha256": file_sha256(tokenizer_dir / "tokenizer.json"),
        "vocab_size": vocab_size,
        "eos_token_id": eos,
    }
    dtype = token_dtype_name(vocab_size)
    version = content_version(dtype, tokenizer_info["sha256"],
                              {name: [s["sha256"] for s in split["shards"]] for name, split in splits.items()})
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": version,
        "dtype": dtype,
        "tokenizer": tokenizer_info,
        "config": config,
        "documents": {"input": input_documents,
                      "output": sum(split["documents"] for split in splits.values())},
        "splits": splits,
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
