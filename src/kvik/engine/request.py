"""Request state inside the engine.

A user request with `n` choices becomes one `RequestGroup` and `n` `Request`s (sequences). Each
sequence is scheduled on its own; siblings share the prompt's KV blocks through the prefix cache.

The scheduler's one rule: a sequence has `num_tokens` known tokens (prompt + sampled output) of which
`num_computed_tokens` have KV in the cache. Every step gives some sequences a number of new tokens to
compute; when all known tokens are computed, the step's logits produce the next token. Prefill,
chunked prefill, prefix-cache hits and recompute after preemption all follow from that.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvik.core.outputs import Logprob, PromptLogprobs, RequestMetrics, SampleLogprobs
from kvik.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(slots=True, eq=False)
class RequestGroup:
    """The user's request: what came in and the `n` sequences answering it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    sequences: list[Request] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int = 0

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
    generator: Any = None  # torch.Generator for seeded sampling, created by the sampler
    detokenizer: Any = None  # IncrementalDetokenizer, created by the output processor
    output_logprobs: SampleLogprobs | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_output_tokens_sent: int = 0
    num_text_sent: int = 0
    num_logprobs_sent: int = 0
    final_output_sent: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[:self.num_prompt_tokens]

    def append_token(self, token_id: int, logprobs: dict[int, Logprob] | None) -> None:
        self.all_token_ids.append(token_id)
        if logprobs is not None:
            if self.output_logprobs is None:
                self.output_logprobs = []
            self.output_logprobs.append(logprobs)
