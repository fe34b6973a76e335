"""Reading the token shards `kvik data` writes, checksums first.

The format is defined in `kvik.core.shard_format` (the data and train packages meet only there). Every
shard's sha256 is checked against the manifest before a single token is read: training on silently
corrupted data wastes the run and is hard to notice afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvik.core.config_files import file_sha256
from kvik.core.errors import ConfigError
from kvik.core.shard_format import TOKEN_DTYPES, load_manifest


class ShardChecksumError(ConfigError):
    """A shard's bytes differ from the manifest's sha256 (corrupted, truncated or replaced)."""


class TokenStream:
    """One split's shards as a single sequence of token ids, memory-mapped, never loaded whole."""

    def __init__(self, shards: list[np.ndarray]) -> None:
        self._shards = shards
        self._starts = np.cumsum([0] + [len(s) for s in shards])  # (num_shards + 1,)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as int64, across shard boundaries if needed."""
        pieces = []
        end = start + length
        index = int(np.searchsorted(self._starts, start, side="right")) - 1
        while start < end:
            offset = start - int(self._starts[index])
            take = min(end - start, len(self._shards[index]) - offset)
            pieces.append(np.asarray(self._shards[index][offset:offset + take], dtype=np.int64))
            start += take
            index += 1
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class TokenDataset:
    """A verified dataset: the manifest and one token stream per split."""

    root: Path
    manifest: dict[str, Any]
    splits: dict[str, TokenStream]

    @property
    def version(self) -> str:
        return self.manifest["version"]

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / self.manifest["tokenizer"]["dir"]

    @property
    def eos_token_id(self) -> int:
        return int(self.manifest["tokenizer"]["eos_token_id"])


def open_dataset(root: str | Path, *, verify: bool = True) -> TokenDataset:
    """Open the shards under `root`; raise ShardChecksumError if any differs from the manifest."""
    root = Path(root)
    manifest = load_manifest(root)
    dtype = np.dtype(TOKEN_DTYPES[manifest["dtype"]])
    tokenizer_file = root / manifest["tokenizer"]["dir"] / "tokenizer.json"
    if verify and file_sha256(tokenizer_file) != manifest["tokenizer"]["sha256"]:
        raise ShardChecksumError(f"{tokenizer_file}: sha256 differs from manifest.json; the "
                                 "tokenizer no longer matches the token ids in the shards")
    splits: dict[str, TokenStream] = {}
    for name, split in manifest["splits"].items():
        arrays = []
        for shard in split["shards"]:
            path = root / shard["file"]
            if verify and (not path.is_file() or file_sha256(path) != shard["sha256"]):
                raise ShardChecksumError(f"{path}: sha256 differs from manifest.json (the shard is "
                                         "corrupted or was replaced); rerun `kvik data run`")
            array = np.memmap(path, dtype=dtype, mode="r")
            if len(array) != shard["tokens"]:
                raise ShardChecksumError(f"{path}: {len(array)} tokens, manifest says {shard['tokens']}")
            arrays.append(array)
        splits[name] = TokenStream(arrays)
    return TokenDataset(root, manifest, splits)
