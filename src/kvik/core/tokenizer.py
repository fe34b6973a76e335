"""Tokenizer wrapper: encoding, safe decoding, chat templates.

Decoding tolerates ids the tokenizer does not know: models such as Qwen pad their embedding matrix
beyond the vocabulary, and a random or fine-tuned model can emit those ids. They decode to nothing
instead of raising.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from kvik.core.errors import ConfigError, InvalidRequestError
from kvik.core.gguf_tokenizer import gguf_tokenizer_dir


class Tokenizer:
    def __init__(self, path: str, revision: str | None = None) -> None:
        try:
            from transformers import AutoTokenizer

            source = path
            if path.lower().endswith(".gguf") and Path(path).is_file():
                source = str(gguf_tokenizer_dir(Path(path)))
            self.hf = AutoTokenizer.from_pretrained(source, revision=revision)
        except ConfigError:
            raise
        except Exception as exc:  # missing files, unknown tokenizer class, bad json
            raise ConfigError(f"tokenizer: could not load a tokenizer from {path} ({exc})") from exc
        # The Rust tokenizer, when there is one, decodes without the Python wrapper's overhead.
        self._backend = getattr(self.hf, "backend_tokenizer", None)
        self.vocab_size = len(self.hf)
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.special_ids = frozenset(self.hf.all_special_ids)
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))
        self.token_text = lru_cache(maxsize=65536)(self._token_text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        known = [i for i in ids if 0 <= i < self.vocab_size]
        if self._backend is not None:
            return self._backend.decode(known, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(known, skip_special_tokens=skip_special_tokens)

    def _token_text(self, token_id: int) -> str:
        """The text of one token on its own (for logprob entries); '' for unknown ids."""
        return self.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                            chat_template: str | None = None, tools: list[dict[str, Any]] | None = None,
                            **template_kwargs: Any) -> str:
        if not self.has_chat_template and chat_template is None:
            raise InvalidRequestError("this model's tokenizer has no chat template; use the completions "
                                      "API or pass a chat template", param="messages")
        try:
            return self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                chat_template=chat_template, tools=tools, **template_kwargs)
        except Exception as exc:  # jinja errors come from the user's messages (e.g. bad roles)
            raise InvalidRequestError(f"messages: the chat template rejected them ({exc})",
                                      param="messages") from exc
