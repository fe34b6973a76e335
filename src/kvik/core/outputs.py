"""What the engine returns: `RequestOutput` with one `CompletionOutput` per choice (vLLM's shape),
or for a pooling request one `PoolingRequestOutput`."""

from __future__ import annotations

import array
import dataclasses
import sys
from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One dict per position: token id -> Logprob, holding the chosen token and the top-k alternatives.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing precedes it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" while None is still running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's life; None where not reached yet."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    extra: dict[str, object] = field(default_factory=dict)


def merge_deltas(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One DELTA output carrying what two consecutive ones carry: what a consumer that fell behind
    gets instead of a backlog of one-token outputs (each one costs it an SSE event to format and
    write, which is how a saturated server's event loop falls further behind)."""
    merged: dict[int, CompletionOutput] = {c.index: dataclasses.replace(c) for c in earlier.outputs}
    for new in later.outputs:
        old = merged.get(new.index)
        if old is None:
            merged[new.index] = new
            continue
        old.text += new.text
        old.token_ids = [*old.token_ids, *new.token_ids]
        if new.logprobs is not None:
            old.logprobs = [*(old.logprobs or []), *new.logprobs]
        old.cumulative_logprob = new.cumulative_logprob
        old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
    return dataclasses.replace(later, prompt_logprobs=earlier.prompt_logprobs or later.prompt_logprobs,
                               outputs=list(merged.values()), extra={**earlier.extra, **later.extra})


@dataclass(slots=True)
class PoolingRequestOutput:
    """A pooling request's result: the embedding, or the classifier's logits (one per label)."""

    request_id: str
    prompt_token_ids: list[int]
    data_bytes: bytes  # little-endian float32, 4 bytes a value
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    finished: bool = True

    @property
    def data(self) -> list[float]:
        values = array.array("f", self.data_bytes)
        if sys.byteorder != "little":
            values.byteswap()
        return values.tolist()
