"""The HF tokenizer of a GGUF file, converted once by transformers and cached.

transformers builds a fast tokenizer from a GGUF's metadata (`tokenizer.ggml.*`: tokens, merges,
token types, special ids, the pre-tokenizer name, `tokenizer.chat_template`) when given `gguf_file=`.
That conversion parses every token string through the `gguf` package's reader, which takes tens of
seconds for a 50k vocabulary, so its result is saved with `save_pretrained` under the cache folder,
keyed by the file's path, size and modification time, and later starts load the saved files.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from kvik.core.cache_dir import kvik_cache_dir
from kvik.core.errors import ConfigError

SAVED_MARKER = "tokenizer_config.json"


def gguf_tokenizer_dir(gguf_path: Path) -> Path:
    """A directory `AutoTokenizer.from_pretrained` loads, holding the tokenizer of `gguf_path`."""
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    key = hashlib.sha256(f"{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:20]
    target = kvik_cache_dir() / "gguf-tokenizers" / f"{resolved.stem}-{key}"
    if (target / SAVED_MARKER).is_file():
        return target
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(resolved.parent), gguf_file=resolved.name)
    except Exception as exc:  # unknown tokenizer model, missing metadata
        raise ConfigError(f"tokenizer: transformers could not build a tokenizer from the metadata "
                          f"of {resolved} ({exc})") from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    # Save beside the target and rename, so two processes starting at once never read half a save.
    scratch = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=target.parent))
    tokenizer.save_pretrained(str(scratch))
    try:
        scratch.rename(target)
    except OSError:  # another process won the race
        shutil.rmtree(scratch, ignore_errors=True)
    return target
