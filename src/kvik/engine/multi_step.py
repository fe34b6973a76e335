"""Multi-step decoding (`num_scheduler_steps` > 1): runs of forwards between scheduler passes.

A step in which every chunk is one token of a plain decode (no drafts, grammar, penalties,
min_tokens, pooling or prompt logprobs) and nobody waits runs up to `num_scheduler_steps` forwards
back to back, each feeding the tokens sampled by the one before (`SchedulerOutput.num_steps`), as
many as fit in MULTI_STEP_SECONDS at the last step's pace. The scheduler's pass, its update, the
output processing and the message to the API process are then paid once a run instead of once a
token.

`MultiStepPlanner` (the scheduler's) decides a run's length and allocates its blocks up front (if
they do not all fit, the step is a single one), capped by every sequence's remaining max_tokens and
context. `run_more_steps` (the core's) drives forwards 2..n. The sampled tokens come back as one list
per sequence, as after a speculative verification, so the scheduler's bookkeeping is the same;
tokens after a stop are dropped there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvik.engine.kv_manager import KVCacheManager
from kvik.engine.request import Request, check_stop

if TYPE_CHECKING:
    from kvik.engine.scheduler import SampledTokens, ScheduledChunk

# The longest a multi-step run should take: a request arriving meanwhile waits for its end, and a
# stream's tokens come in groups this far apart. At one sequence a CPU decode step takes a few ms,
# so runs are long; at tens of sequences a step alone takes this long, and runs are single steps.
MULTI_STEP_SECONDS = 0.025


class MultiStepPlanner:
    def __init__(self, num_scheduler_steps: int) -> None:
        self.num_scheduler_steps = num_scheduler_steps
        # Seconds the last step took per forward (observe); a run of forwards is kept within
        # MULTI_STEP_SECONDS, so its cap follows the batch: long at one sequence, none at many.
        self.seconds_per_forward = float("inf")

    def observe(self, seconds: float, forwards: int) -> None:
        """How long the last step took and how many forwards it ran."""
        self.seconds_per_forward = seconds / max(forwards, 1)

    def plan(self, chunks: list[ScheduledChunk], kv: KVCacheManager, max_model_len: int) -> int:
        """How many forwards this step may run back to back: up to num_scheduler_steps when every
        chunk is a plain decode token, capped by each sequence's remaining output and context, and
        1 unless the blocks for all of them can be had without preempting anyone. The caller asks
        only while nobody waits: a sequence arriving meanwhile waits for the run to end."""
        steps = min(self.num_scheduler_steps, int(MULTI_STEP_SECONDS / self.seconds_per_forward))
        if steps <= 1:
            return 1
        for chunk in chunks:
            request = chunk.request
            if not (chunk.num_new_tokens == 1 and not chunk.spec_token_ids and request.multi_step_ok
                    and chunk.start + 1 == request.num_tokens):
                return 1
            steps = min(steps, request.max_tokens - request.num_output_tokens, max_model_len - request.num_tokens)
        if steps <= 1:
            return 1
        for chunk in chunks:
            if not kv.allocate_slots(chunk.request, steps):
                return 1  # blocks taken for the others are theirs for the next steps anyway
            chunk.block_ids = kv.block_ids(chunk.request)
        return steps


def run_more_steps(decode_next: Callable[[list[ScheduledChunk], int, list[int]], Any],
                   sample: Callable[[Any, list[Request]], Any], chunks: list[ScheduledChunk], num_steps: int,
                   token_ids: list[int], new_tokens: dict[Request, SampledTokens], *,
                   eos_token_ids: frozenset[int], max_model_len: int,
                   greedy_steps: Callable[..., list[list[int]] | None] | None = None) -> int:
    """The rest of a run: forwards 2..num_steps (`decode_next`, the runner's), each computing the
    tokens the one before sampled (`sample`, the sampler), appended to `new_tokens`. Stops early once
    every sequence has sampled a stop token; the scheduler's update drops what a sequence sampled
    after its stop. The sequences qualify (Request.multi_step_ok), so nothing in their sampling reads
    the tokens of this run, and the draws happen in the order single steps would make them. Where
    every sequence decodes greedily with no logprobs or logit bias, `greedy_steps` (the runner's)
    runs all those forwards and their argmax in one compiled call when it can. Returns the number of
    forwards the whole step ran."""
    requests = [chunk.request for chunk in chunks]
    # A token that ends its sequence. The sequences are as before the run (their tokens are
    # appended by the scheduler's update), which leaves check_stop the stop and end-of-sequence
    # tokens to find: runs are capped by max_tokens and the context, and have no min_tokens.
    live = [check_stop(request, token, eos_token_ids, max_model_len) is None
            for request, token in zip(requests, token_ids)]
    if not any(live):
        return 1
    if greedy_steps is not None and all(_plain_greedy(request) for request in requests):
        # The tokens check_stop would stop at, given no min_tokens: end of sequence unless ignored,
        # and the request's stop token ids.
        stop_ids = [[*(() if r.params.ignore_eos else sorted(eos_token_ids)), *r.params.stop_token_ids]
                    for r in requests]
        steps = greedy_steps(chunks, token_ids, num_steps - 1, stop_ids, live)
        if steps is not None:
            for step_tokens in steps:
                for request, token in zip(requests, step_tokens):
                    new_tokens[request].token_ids.append(token)
            return 1 + len(steps)
    for step in range(1, num_steps):
        if not any(live):
            return step
        sampled = sample(decode_next(chunks, step, token_ids), requests)
        token_ids = sampled.token_ids
        for row, (request, token, logprob) in enumerate(zip(requests, token_ids, sampled.logprobs)):
            entry = new_tokens[request]
            entry.token_ids.append(token)
            if entry.logprobs is not None:
                entry.logprobs.append(logprob)
            if live[row] and check_stop(request, token, eos_token_ids, max_model_len) is not None:
                live[row] = False
    return num_steps


def _plain_greedy(request: Request) -> bool:
    """Chosen by the argmax of the raw logits alone: greedy, no logprobs, no logit bias (the other
    logit processors do not run under multi-step decoding: Request.multi_step_ok)."""
    params = request.params
    return params.greedy and params.logprobs is None and not params.logit_bias
