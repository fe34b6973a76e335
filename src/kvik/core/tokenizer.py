"""Tokenizer: encoding, safe decoding and chat templates, on the Rust `tokenizers` backend alone.

transformers is used once, to read a model's tokenizer files the way HF does (its classes adjust the
backend, e.g. the BOS post-processor of Llama tokenizers), and what it produced is captured in a
`TokenizerSpec`: the backend's JSON, the chat template and the special tokens. Everything else
(the API server, its tokenization workers) builds a `Tokenizer` from the spec, so the front end of
`kvik serve` never imports transformers or torch. Chat templates render in kvik's sandbox
(`kvik.core.chat_template`), with the same environment transformers gives them.

Decoding tolerates ids the tokenizer does not know: models such as Qwen pad their embedding matrix
beyond the vocabulary, and a random or fine-tuned model can emit those ids. They decode to nothing
instead of raising.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvik.core.chat_template import ChatTemplateRenderer, TemplateLimits
from kvik.core.errors import ConfigError, InvalidRequestError
from kvik.core.gguf_tokenizer import gguf_tokenizer_dir

# transformers' special-token attributes, passed to chat templates as variables (bos_token, ...).
SPECIAL_TOKEN_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                            "cls_token", "mask_token")


@dataclass(slots=True)
class TokenizerSpec:
    """A tokenizer as plain data: cheap to send to another process and to rebuild there."""

    backend_json: str  # the `tokenizers` JSON, as transformers configured the backend
    chat_template: str | dict[str, str] | None = None  # one template, or named ones ("default", ...)
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token -> "<s>", ...
    eos_token_id: int | None = None
    bos_token_id: int | None = None
    special_ids: list[int] = field(default_factory=list)
    vocab_size: int = 0  # the tokenizer's, added tokens included (the model's may be larger)
    tokenizer_class: str = ""
    model_max_length: int | None = None
    add_bos_token: bool | None = None

    @classmethod
    def from_pretrained(cls, path: str, revision: str | None = None) -> TokenizerSpec:
        """Read a tokenizer directory (or hub id) through transformers. Imports torch."""
        try:
            from transformers import AutoTokenizer

            source = path
            if path.lower().endswith(".gguf") and Path(path).is_file():
                source = str(gguf_tokenizer_dir(Path(path)))
            hf = AutoTokenizer.from_pretrained(source, revision=revision)
        except ConfigError:
            raise
        except Exception as exc:  # missing files, unknown tokenizer class, bad json
            raise ConfigError(f"tokenizer: could not load a tokenizer from {path} ({exc})") from exc
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise ConfigError(f"tokenizer: {type(hf).__name__} at {path} has no fast (Rust) backend; "
                              "kvik needs a tokenizer.json or a tokenizer transformers can convert")
        special = {name: str(getattr(hf, name)) for name in SPECIAL_TOKEN_ATTRIBUTES
                   if getattr(hf, name, None) is not None}
        max_length = getattr(hf, "model_max_length", None)
        return cls(
            backend_json=backend.to_str(), chat_template=getattr(hf, "chat_template", None) or None,
            special_tokens=special, eos_token_id=hf.eos_token_id, bos_token_id=hf.bos_token_id,
            special_ids=sorted(set(hf.all_special_ids)), vocab_size=len(hf),
            tokenizer_class=type(hf).__name__,
            model_max_length=max_length if isinstance(max_length, int) and max_length < 2**40 else None,
            add_bos_token=getattr(hf, "add_bos_token", None),
        )


class Tokenizer:
    def __init__(self, spec: TokenizerSpec, limits: TemplateLimits | None = None) -> None:
        from tokenizers import Tokenizer as Backend

        self.spec = spec
        self.backend = Backend.from_str(spec.backend_json)
        # Some tokenizer.json files (BERT's, sentence-transformers') switch on padding to a fixed
        # length or truncation: ids of one prompt must be exactly its tokens, and a prompt too long
        # is refused with a message, never cut silently.
        self.backend.no_padding()
        self.backend.no_truncation()
        self.vocab_size = spec.vocab_size or self.backend.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = spec.eos_token_id
        self.special_ids = frozenset(spec.special_ids)
        self.chat = ChatTemplateRenderer(spec.chat_template, spec.special_tokens, limits)
        self.token_text = lru_cache(maxsize=65536)(self._token_text)
        self._max_token_bytes: int | None = None

    @classmethod
    def from_pretrained(cls, path: str, revision: str | None = None) -> Tokenizer:
        return cls(TokenizerSpec.from_pretrained(path, revision))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as exc:  # e.g. lone surrogates, which UTF-8 cannot hold
            raise InvalidRequestError(f"prompt: could not be tokenized ({exc})", param="prompt") from exc

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        known = [i for i in ids if 0 <= i < self.vocab_size]
        return self.backend.decode(known, skip_special_tokens=skip_special_tokens)

    def _token_text(self, token_id: int) -> str:
        """The text of one token on its own (for logprob entries); '' for unknown ids."""
        return self.decode([token_id], skip_special_tokens=False)

    @property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes any single token stands for. A text of B bytes has at least
        B / max_token_bytes tokens, which bounds a prompt's length before tokenizing it."""
        if self._max_token_bytes is None:
            vocab = self.backend.get_vocab(with_added_tokens=True)
            longest = max((len(self.token_text(i).encode()) for i in vocab.values()), default=1)
            self._max_token_bytes = max(1, longest)
        return self._max_token_bytes

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                            chat_template: str | None = None, tools: list[dict[str, Any]] | None = None,
                            **template_kwargs: Any) -> str:
        return self.chat.render(messages, add_generation_prompt=add_generation_prompt,
                                template=chat_template, tools=tools, template_kwargs=template_kwargs)
