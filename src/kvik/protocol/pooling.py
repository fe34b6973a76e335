"""Request schemas of the pooling endpoints: OpenAI's embeddings API and vLLM's classify API.

`input` takes the four shapes OpenAI documents: a string, a list of strings, a list of token ids,
or a list of token-id lists. Responses are built as plain dicts by the server.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictInt

from kvik.protocol.openai import SchedulingFields

# OpenAI's limit on inputs per embeddings request.
MAX_INPUTS = 2048

# Strict: "12" or true is not a token id.
TokenIds = list[Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]]
PoolingInput = str | list[str] | TokenIds | list[TokenIds]


class EmbeddingRequest(SchedulingFields):
    model: str | None = None
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    # Matryoshka models only: keep the first `dimensions` values (renormalised).
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


class ClassifyRequest(SchedulingFields):
    """vLLM's /classify: each input through a `*ForSequenceClassification` model's score head."""

    model: str | None = None
    input: PoolingInput
    user: str | None = None
