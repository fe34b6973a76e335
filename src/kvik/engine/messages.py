"""Typed messages between a front end (the API server, the offline `LLM`) and the engine core.

The core schedules, runs the model and samples, in token ids only. Everything that deals in text
(chat templates, tokenizing, detokenizing, stop strings, the text of logprob tokens) stays in the
front end, so the core's step loop does no string work and the server process never imports torch.
Messages are msgspec structs, sent as msgpack when the core runs in its own process
(`kvik.engine.core_process`); in-process they are passed as they are.

Front end -> core: `EngineCoreRequest` (add), `AbortRequests`, `UtilityCall`.
Core -> front end: `EngineCoreOutputs` (the sequences that produced tokens in one step, plus the
engine's stats), and once at start `EngineInfo`.
"""

from __future__ import annotations

import msgspec

from kvik.core.pooling_params import PoolingParams
from kvik.core.sampling_params import SamplingParams
from kvik.core.tokenizer import TokenizerSpec


class EngineCoreRequest(msgspec.Struct, tag="add", omit_defaults=True):
    """One validated request: prompt token ids and resolved limits. The front end checked it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # output tokens allowed: params.max_tokens capped by the context length
    arrival_time: float
    # Prefix-cache isolation (issue: one tenant must not learn another's prompts by timing): blocks
    # that end after `salt_from_token` hash with the salt, so only tenants with the same salt share
    # them; blocks inside the leading system prompt stay shared.
    cache_salt: str | None = None
    salt_from_token: int = 0
    # Scheduling (`kvik.engine.scheduling_policy`): vLLM's priority (lower is served first), and the
    # tenant whose fair share of tokens this request counts against, with the tenant's weight.
    priority: int = 0
    tenant: str = ""
    tenant_weight: float = 1.0
    # A pooling request (embed, classify): the prompt is computed once and its pooled hidden state
    # comes back instead of tokens; `params` and `max_tokens` are then unused.
    pooling: PoolingParams | None = None
    # Multi-LoRA serving: the adapter (registered with the core by this name) that computes this
    # request; None for the base model.
    lora_name: str | None = None


class AbortRequests(msgspec.Struct, tag="abort"):
    """Stop sequences now and free their blocks. index -1 means every sequence of the request."""

    targets: list[tuple[str, int]]


class UtilityCall(msgspec.Struct, tag="utility"):
    """A call on the core outside the request path (reset_prefix_cache, ...); answered by a
    `UtilityResult` with the same call_id."""

    call_id: int
    method: str
    args: list = msgspec.field(default_factory=list)


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


EngineCoreInput = EngineCoreRequest | AbortRequests | UtilityCall | Shutdown


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs at one position: the chosen (or prompt) token first, then the top-k alternatives
    not already listed. ranks: 1 = the most likely token."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one sequence produced in one step."""

    request_id: str
    index: int
    new_token_ids: list[int] = msgspec.field(default_factory=list)
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    first_scheduled_time: float | None = None
    # Every prompt position's logprobs, sent once on sequence 0 when all are computed.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None  # the step failed for this request (finish_reason "error")
    # A pooling request's result, once, with finish_reason "stop": the embedding or the class
    # logits as little-endian float32 (4 bytes a value; what base64 encoding sends as is).
    pooled: bytes | None = None


class EngineStats(msgspec.Struct):
    """A snapshot for metrics; token counters are totals since start."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks referenced by sequences
    num_blocks: int = 0
    num_free_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # Speculative decoding: verifications, draft tokens proposed and accepted, and accepted drafts
    # by position (index i: the (i+1)-th draft of a step); all zero when it is off.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)
    # Per priority value (tiers): sequences preempted, and sequences waiting now.
    preemptions_by_priority: dict[int, int] = msgspec.field(default_factory=dict)
    waiting_by_priority: dict[int, int] = msgspec.field(default_factory=dict)
    # Multi-LoRA (all zero without --enable-lora): adapters registered and sitting in slots now,
    # adapters copied into a slot, and of those read from their directory again (CPU cache miss).
    lora_adapters: int = 0
    lora_adapters_in_slots: int = 0
    lora_slot_loads: int = 0
    lora_disk_loads: int = 0


class UtilityResult(msgspec.Struct, array_like=True):
    call_id: int
    result: object = None
    error: str | None = None
    # A KvikError's class name (kvik.core.errors) and param, so the front end raises the same typed
    # error (and the server answers with its HTTP status) instead of a 500.
    error_type: str | None = None
    error_param: str | None = None


class LoRAAdapterInfo(msgspec.Struct):
    """A LoRA adapter the core serves (kvik.engine.lora_manager)."""

    name: str
    lora_id: int  # unique per registration; part of the prefix-cache hash
    path: str
    rank: int
    target_modules: list[str]
    created: int  # unix seconds


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    stats: EngineStats | None = None
    utility: UtilityResult | None = None


class PoolingInfo(msgspec.Struct):
    """How the model pools, for the front end's checks and responses."""

    method: str  # "mean" | "cls" | "last"
    normalize: bool  # embeddings are L2-normalised
    hidden_size: int  # values in an embedding
    # Matryoshka models: `dimensions` may truncate (then renormalised); an empty list with
    # `matryoshka` true means any size up to hidden_size.
    matryoshka: bool = False
    matryoshka_dimensions: list[int] = msgspec.field(default_factory=list)
    labels: list[str] = msgspec.field(default_factory=list)  # classify: one name per logit


class EngineInfo(msgspec.Struct, tag="info"):
    """What the front end learns from the core once it has loaded the model."""

    model_path: str
    architecture: str
    max_model_len: int
    vocab_size: int  # the model's (embedding rows); may exceed the tokenizer's
    eos_token_ids: list[int]
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    device: str
    dtype: str
    weight_bytes: int
    tokenizer: TokenizerSpec
    kv_cache_bytes: int = 0  # the KV cache's allocation (weights + this = the model's footprint)
    tasks: list[str] = msgspec.field(default_factory=lambda: ["generate"])  # see kvik.core.pooling_params
    pooling: PoolingInfo | None = None
    # What the weights, activations and KV cache are stored in (kvik.model.quant.Precision.describe).
    precision: str = ""
    # Multi-LoRA serving (--enable-lora): the slots, the largest rank, and the adapters at start.
    enable_lora: bool = False
    max_loras: int = 0
    max_lora_rank: int = 0
    lora_adapters: list[LoRAAdapterInfo] = msgspec.field(default_factory=list)


class StartupFailed(msgspec.Struct, tag="failed"):
    """The core could not start (bad config, no memory for the KV cache, ...)."""

    message: str
    error_type: str  # the KvikError class name, for the launcher's message


def input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineCoreInput)


def output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineCoreOutputs)


def startup_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineInfo | StartupFailed)
