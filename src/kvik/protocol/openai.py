"""OpenAI request schemas (pydantic) for the chat and completions APIs, with vLLM's extensions.

Unknown fields are ignored, not rejected: clients (LangChain, lm-evaluation-harness, guidellm) send
extras. Bounds follow OpenAI where it documents them, so bad values fail validation with a 400 that
names the field instead of reaching the engine. Responses are built as plain dicts by the server, in
exactly OpenAI's shape.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# One request may not fan out into an unbounded number of sequences.
MAX_N = 64
MAX_STOP_STRINGS = 16
# The sampler applies a request's logit bias and checks its stop token ids at every step, in the
# step every other request waits on: a bias over the whole vocabulary or a million stop ids would
# slow every tenant's tokens. 300 is OpenAI's limit for logit_bias.
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 300

TokenIds = list[Annotated[int, Field(ge=0, le=2**31 - 1)]]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class ContentPart(_Request):
    """Any content part; only text parts are supported, others fail with a clear 400."""

    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    # A reasoning model's earlier thinking, for templates that render it (vLLM's field).
    reasoning_content: str | None = None


# -- structured outputs --


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(default="response", max_length=256)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs`: exactly one constraint. Unknown keys are refused, not ignored:
    a constraint kvik would silently drop must be a 400."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# -- tools --


class FunctionDefinition(_Request):
    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class SchedulingFields(_Request):
    """Scheduling, on every request that reaches the engine (vLLM's `priority`: lower is served
    first; kvik's `tenant` and `tenant_weight`: the fair-share group and its weight). Trusted like
    every field from whoever holds the server's key; the gateway overwrites all three from the
    caller's API key, so its clients cannot set them."""

    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    tenant: str | None = Field(default=None, min_length=1, max_length=256)
    tenant_weight: float = Field(default=1.0, gt=0, le=1000)


class _SamplingFields(SchedulingFields):
    """Fields shared by chat and completions, including vLLM's extensions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0, le=100)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    user: str | None = None
    # vLLM extensions
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=100)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Prefix-cache isolation: requests share cached prompt blocks (past the leading system prompt)
    # only with requests carrying the same salt. The gateway sets it per tenant.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_*
    # fields; at most one of them per request.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None  # refused: kvik's JSON whitespace is fixed
    guided_decoding_backend: str | None = None  # ignored: the server has one grammar engine

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return [s for s in stops if s]

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None and len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens, got {len(value)}")
        for key, bias in (value or {}).items():
            # isdigit() alone accepts '²' and other Unicode digits that int() refuses.
            if not (key.strip().isascii() and key.strip().isdigit()) or len(key.strip()) > 10:
                raise ValueError(f"keys must be token ids (decimal integers), got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"bias for token {key} must be in [-100, 100], got {bias}")
        return value

    @property
    def include_usage_chunk(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    # A template of the request's own: refused unless the server runs with
    # --trust-request-chat-template (it is code the server would run).
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's shape): serve the PEFT adapter directory `lora_path` on
    the server's machine as the model `lora_name`."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None  # rendered into the chat template with the messages
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: TokenIds
