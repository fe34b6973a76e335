"""The token-shard format: what `kvik data` writes and `kvik train` reads, defined once.

- `<split>-<NNNNN>.bin`: little-endian token ids, `uint16` when the vocabulary fits, else `uint32`;
  each document is followed by the tokenizer's end-of-text id; a document never spans two shards.
- `tokenizer/`: tokenizer.json and tokenizer_config.json (HF format, with the chat template).
- `manifest.json`: {"format": "kvik-token-shards/1", "version", "dtype", "tokenizer": {"dir",
  "sha256", "vocab_size", "eos_token_id"}, "config", "documents": {"input", "output"}, "splits":
  {"train"|"val": {"documents", "tokens", "shards": [{"file", "documents", "tokens", "sha256"}]}}}.
  `version` is a hash of the content (tokenizer and shard hashes), so identical data has the same
  version whatever its path or config.

The writer (kvik.data.shards) and the reader (kvik.train.shards) may not import each other; both
import this module.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from kvik.core.errors import ConfigError

MANIFEST_FORMAT = "kvik-token-shards/1"
# numpy dtype strings, little-endian, by manifest name.
TOKEN_DTYPES = {"uint16": "<u2", "uint32": "<u4"}


def token_dtype_name(vocab_size: int) -> str:
    """The narrowest dtype that holds every token id."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_file_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


def content_version(dtype: str, tokenizer_sha256: str, shard_sha256s: dict[str, list[str]]) -> str:
    """The dataset's version: a hash of what it holds, not of where it lies or how it was made."""
    content = json.dumps({"dtype": dtype, "tokenizer": tokenizer_sha256, "shards": shard_sha256s},
                         sort_keys=True)
    return hashlib.sha256(content.encode()).hexdigest()[:16]


def load_manifest(root: str | Path) -> dict[str, Any]:
    path = Path(root) / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"data.shards: cannot read {path} ({exc.strerror}); run `kvik data run` "
                          "first") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ConfigError(f"{path}: format {manifest.get('format')!r} is not {MANIFEST_FORMAT}")
    if manifest.get("dtype") not in TOKEN_DTYPES:
        raise ConfigError(f"{path}: dtype {manifest.get('dtype')!r} is not one of {', '.join(TOKEN_DTYPES)}")
    return manifest
