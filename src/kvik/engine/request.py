"""Request state inside the engine core.

A user request with `n` choices becomes one `RequestGroup` and `n` `Request`s (sequences). Each
sequence is scheduled on its own; siblings share the prompt's KV blocks through the prefix cache.

The scheduler's one rule: a sequence has `num_tokens` known tokens (prompt + sampled output) of which
`num_computed_tokens` have KV in the cache. Every step gives some sequences a number of new tokens to
compute; when all known tokens are computed, the step's logits produce the next token. Prefill,
chunked prefill, prefix-cache hits and recompute after preemption all follow from that.

The core deals in token ids only: text, stop strings and logprob token text live in the front end
(`kvik.engine.output_processor`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvik.core.pooling_params import PoolingParams
from kvik.core.sampling_params import SamplingParams
from kvik.engine.messages import TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed: recomputes its tokens (or hits the prefix cache) when resumed
    SUSPENDED = "suspended"  # out of the batch for a better-ranked sequence, its blocks kept
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


@dataclass(slots=True, eq=False)
class RequestGroup:
    """The user's request: what came in and the `n` sequences answering it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    sequences: list[Request] = field(default_factory=list)
    first_scheduled_time: float | None = None
    num_cached_tokens: int = 0
    # Prompt logprobs: one entry per prompt token (the first is None), filled chunk by chunk.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False
    # Extra bytes mixed into the hash of every prefix-cache block ending after `salt_from_token`.
    cache_salt: bytes = b""
    salt_from_token: int = 0
    # Scheduling: priority tier (lower first) and the tenant whose fair share it counts against.
    priority: int = 0
    tenant: str = ""
    tenant_weight: float = 1.0
    # Multi-LoRA serving: the adapter's registration id (kvik.engine.lora_manager), 0 for the base
    # model. Part of every prefix-cache block's hash: adapters never share KV.
    lora_id: int = 0

    @property
    def finished(self) -> bool:
        return all(seq.status.finished for seq in self.sequences)


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated."""

    seq_id: str  # unique in the engine: "<request_id>#<index>"
    group: RequestGroup
    index: int
    params: SamplingParams
    max_tokens: int  # output tokens allowed (params.max_tokens capped by the context length)
    all_token_ids: list[int]  # prompt followed by outputs
    num_prompt_tokens: int
    arrival_order: int  # FCFS position; preempted sequences keep theirs
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    # Wait for sibling 0 to compute the prompt, then reuse its blocks from the prefix cache.
    wait_for_prompt_of: Request | None = None
    # Prompt logprobs need logits at every prompt position: such a sequence does not read the
    # prefix cache, and after a preemption it skips positions already scored.
    wants_prompt_logprobs: bool = False
    num_prompt_logprobs_done: int = 0
    # A pooling request produces one vector when its prompt is computed, and no tokens.
    pooling: PoolingParams | None = None
    # Compute the prompt in one step, with no prefix-cache hit: an encoder (no KV cache to continue
    # from) or pooling that reads every row (mean, CLS).
    needs_whole_prompt: bool = False
    generator: Any = None  # torch.Generator for seeded sampling, created by the sampler
    # Structured outputs: the sequence's grammar matcher (kvik.engine.structured.matcher.GrammarState),
    # advanced by each sampled token; it follows the tokens, so preemption keeps it valid.
    grammar: Any = None
    # Speculative decoding (kvik.engine.spec_decode): draft tokens proposed after the last step, to
    # be computed after the known tokens and verified in the next one (the scheduler counts them in
    # its budget and may drop some); and the proposer's state for this sequence (adaptive k, the
    # draft distributions).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_state: Any = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    # The LoRA slot this sequence pinned at admission (kvik.engine.lora_manager), -1 for none.
    lora_slot: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def multi_step_ok(self) -> bool:
        """Whether forwards may run back to back for this sequence, each sampling from the one
        before without the scheduler in between (multi-step decoding): nothing in its sampling
        depends on the tokens it has produced (penalties, min_tokens) or on per-token state (a
        grammar), and it is a plain generation on the base model."""
        params = self.params
        return (self.grammar is None and self.pooling is None and not self.wants_prompt_logprobs
                and self.lora_slot < 0 and not params.min_tokens and params.repetition_penalty == 1.0
                and not params.presence_penalty and not params.frequency_penalty)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[:self.num_prompt_tokens]

    def block_hash_extra(self, block_index: int, block_size: int) -> bytes:
        """What separates this sequence's block `block_index` from other tenants' in the prefix
        cache: the salt, once the block reaches past the shared leading tokens; and the LoRA
        adapter, from the first block (its KV differs from the base model's everywhere)."""
        group = self.group
        extra = b"lora:%d;" % group.lora_id if group.lora_id else b""
        if group.cache_salt and (block_index + 1) * block_size > group.salt_from_token:
            return extra + group.cache_salt
        return extra


def check_stop(request: Request, token_id: int, eos_token_ids: frozenset[int],
               max_model_len: int) -> tuple[RequestStatus, int | None] | None:
    """Token-level stop conditions, checked after `token_id` was appended: end of sequence (unless
    ignore_eos), a stop token id (both only after min_tokens), max_tokens, the context length.
    Stop strings are text and are checked by the front end. A constrained sequence samples an
    end-of-sequence token only when its grammar is complete, and then stops whatever min_tokens says."""
    params = request.params
    num_output = request.num_output_tokens
    grammar_done = request.grammar is not None and request.grammar.active and token_id in eos_token_ids
    if grammar_done:
        return RequestStatus.FINISHED_STOPPED, None
    if num_output >= params.min_tokens:
        if not params.ignore_eos and token_id in eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token_id
    if num_output >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None
