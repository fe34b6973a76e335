"""Request schema of OpenAI's Responses API (`POST /v1/responses`).

Input items are kept as plain dicts here and checked one by one when they are turned into chat
messages (`kvik.server.serving.responses_api`), so a bad item gets a 400 naming its position and
what to send instead, rather than a union validation error listing every item type.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from kvik.protocol.openai import SchedulingFields, _Request


class TextFormat(_Request):
    """`text.format`: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name",
    "schema", "strict", "description"}."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


class ResponsesRequest(SchedulingFields):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=128)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    # Extensions kvik's chat API has too.
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        # OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512.
        if value is not None:
            if len(value) > 16:
                raise ValueError("at most 16 key-value pairs")
            for key, item in value.items():
                if len(key) > 64 or len(item) > 512:
                    raise ValueError(f"key {key[:64]!r}: keys are at most 64 characters, values 512")
        return value
