"""`SpecDecoder`: what the engine core calls to propose drafts and to verify them.

`propose(running)` runs after a step: for every running sequence whose next step decodes it asks
its adaptive k (`adaptive.py`), caps it so the accepted tokens cannot pass max_tokens or the context
length, and stores the proposer's drafts in `Request.spec_token_ids`. `verify(logits, slices)` runs
inside a step, on the logits the model runner returned for chunks with drafts: it scores each row
as the sampler would (logit processors see the drafts before that row as already generated), keeps
what `rejection.py` accepts, and returns the tokens with their logprobs for the scheduler.

Seeded requests draw every random number (draft choices, acceptance tests, resampling) from their
own generator, in an order fixed by their own history, so a seeded request with speculation on is
reproducible whatever shares its batch; its tokens differ from those with speculation off (same
distribution, another realisation), as in other engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvik.core.config import EngineArgs
from kvik.core.errors import ConfigError
from kvik.core.tokenizer import TokenizerSpec
from kvik.engine.cuda_graphs import GraphSettings
from kvik.engine.model_runner import VerifySlice
from kvik.engine.request import Request, RequestStatus
from kvik.engine.sampler import Sampler, argmax_rows, prompt_logprobs_for
from kvik.engine.scheduler import SampledTokens
from kvik.engine.spec_decode.adaptive import AdaptiveK
from kvik.engine.spec_decode.proposer import DraftContext, Proposer
from kvik.engine.spec_decode.rejection import greedy_accept, speculative_sample

# The adaptive k's cost model, relative to one decode step of the target. Fitted on CPU (float32,
# SmolLM2-135M, one thread, the compiled decode stack; bench/spec_decode.py): with every draft
# accepted, k = 1 ran 1.30x and k = 3 2.03x the speed of plain decoding, i.e. a verification costs
# about 1 + 0.33 + 0.21 k steps. Past 3 drafts a single sequence's step leaves the compiled decode
# stack (1-4 rows) and k = 4 or 5 ran only 1.3-1.4x: hence the default of 3 drafts.
VERIFY_ROW_COST = 0.2
VERIFY_FIXED_COST = 0.3
# A draft-model step costs at least this fraction of a target step whatever the draft's size (the
# Python and dispatch around any forward), plus the ratio of the weights it reads.
DRAFT_STEP_FLOOR = 0.15
# What a new sequence's adaptive k assumes of each draft before it has seen any verified (worth
# three drafts of evidence). A prompt lookup usually finds nothing in new text, so it starts
# doubtful; a draft model is chosen to agree with the target (a quantized copy of SmolLM2-135M
# agrees on 94-99 % of greedy tokens with int8, 70 % with int4), and with the ngram's 2/3 its
# cost of ~0.5 target steps a draft would keep it off until slow probes proved otherwise.
PRIOR_ACCEPTANCE = {"ngram": 2 / 3, "draft": 0.8}


@dataclass(slots=True)
class SpecState:
    """A sequence's speculative-decoding state (`Request.spec_state`)."""

    adaptive: AdaptiveK
    draft_probs: torch.Tensor | None = None  # (k, V) the pending drafts' distributions; None: point masses
    proposer_state: Any = None  # the proposer's own (the n-gram index)


@dataclass(slots=True)
class SpecDecodeStats:
    """Totals since start, for metrics."""

    num_drafts: int = 0  # verifications of at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i


class SpecDecoder:
    def __init__(self, proposer: Proposer, *, max_k: int, cost_per_draft: float, adaptive: bool,
                 max_model_len: int, kv_bytes_per_block: int = 0, cost_fixed: float = VERIFY_FIXED_COST,
                 prior_acceptance: float = PRIOR_ACCEPTANCE["ngram"]) -> None:
        self.proposer = proposer
        self.prior_acceptance = prior_acceptance
        self.max_k = max_k
        self.cost_per_draft = cost_per_draft
        self.cost_fixed = cost_fixed
        self.adaptive = adaptive
        self.max_model_len = max_model_len
        self.kv_bytes_per_block = kv_bytes_per_block  # the proposer's KV next to each target block
        self.sampler: Sampler | None = None
        self.stats = SpecDecodeStats(accepted_per_position=[0] * max_k)

    def start(self, num_blocks: int, sampler: Sampler, graphs: GraphSettings | None = None) -> None:
        """Allocate the proposer's state; `graphs`: the target's decode-graph settings, which a draft
        model's own runner follows."""
        self.sampler = sampler
        start = getattr(self.proposer, "start", None)
        if start is not None:
            start(num_blocks, sampler, graphs)

    def propose(self, running: list[Request]) -> None:
        """Drafts for the running sequences whose next step decodes one token."""
        candidates: list[Request] = []
        num_drafts: list[int] = []
        for request in running:
            # A constrained sequence (structured outputs) gets no drafts: its grammar would have to
            # check each draft and rewind on rejection; it decodes one token at a time instead.
            if (request.status is not RequestStatus.RUNNING or request.pooling is not None
                    or request.grammar is not None or request.num_tokens - request.num_computed_tokens != 1):
                continue
            state = request.spec_state
            if state is None:
                state = request.spec_state = SpecState(AdaptiveK.with_prior(
                    self.max_k, self.cost_per_draft, self.cost_fixed, self.adaptive, self.prior_acceptance))
            # k drafts add at most k + 1 tokens, each at a position inside the context.
            k = min(state.adaptive.next_k(), request.max_tokens - request.num_output_tokens - 1,
                    self.max_model_len - request.num_tokens - 1)
            if k > 0:
                candidates.append(request)
                num_drafts.append(k)
        # Called even with no candidates: a proposer frees what finished sequences held.
        for request, draft in zip(candidates, self.proposer.propose(candidates, num_drafts)):
            if draft is not None and draft.token_ids:
                request.spec_token_ids = list(draft.token_ids)
                request.spec_state.draft_probs = draft.probs

    def verify(self, logits: torch.Tensor, slices: list[VerifySlice]) -> dict[Request, SampledTokens]:
        """logits: the runner's; each slice holds a chunk's k + 1 rows. Returns the accepted drafts
        plus one token per sequence."""
        results: dict[Request, SampledTokens] = {}
        for piece in slices:
            request = piece.chunk.request
            drafts = piece.chunk.spec_token_ids
            k = len(drafts)
            rows = logits[piece.row_start:piece.row_start + piece.num_rows]  # (k + 1, V)
            contexts = [DraftContext(request, drafts[:j]) for j in range(k + 1)]
            processed = self.sampler.processed(rows, contexts)
            state: SpecState = request.spec_state
            if request.params.greedy:
                tokens = greedy_accept(argmax_rows(processed).tolist(), drafts)
            else:
                target = self.sampler.distribution(processed, contexts)
                draft_probs = state.draft_probs[:k] if state.draft_probs is not None else None
                tokens = speculative_sample(target, drafts, draft_probs, self.sampler.generator_for(request))
            state.draft_probs = None
            logprobs = (prompt_logprobs_for(rows[:len(tokens)], tokens, request.params.logprobs)
                        if request.params.logprobs is not None else None)
            results[request] = SampledTokens(tokens, logprobs)
            self._record(state, k, len(tokens) - 1)
        return results

    def _record(self, state: SpecState, proposed: int, accepted: int) -> None:
        state.adaptive.observe(proposed, accepted)
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += proposed
        stats.num_accepted_tokens += accepted
        for position in range(accepted):
            stats.accepted_per_position[position] += 1


def build_spec_decoder(args: EngineArgs, *, tokenizer: TokenizerSpec, vocab_size: int, device: torch.device,
                       dtype: torch.dtype, max_model_len: int, max_num_batched_tokens: int,
                       target_step_bytes: int) -> SpecDecoder | None:
    """The decoder for `args.speculative_method`, or None when speculation is off. A draft model
    is loaded here: call before sizing the KV cache (`kv_bytes_per_block`). `target_step_bytes`:
    the weights one decode step of the target streams (its linear layers)."""
    method = args.speculative_method
    if method is None:
        return None
    common = dict(max_k=args.num_speculative_tokens, adaptive=args.speculative_adaptive,
                  max_model_len=max_model_len)
    if method == "ngram":
        from kvik.engine.spec_decode.ngram import NgramProposer

        proposer = NgramProposer(args.prompt_lookup_min, args.prompt_lookup_max)
        return SpecDecoder(proposer, cost_per_draft=VERIFY_ROW_COST, **common)
    if method == "draft":
        from kvik.engine.spec_decode.draft_model import DraftModelProposer

        # No draft model named (--speculative-quantization alone): the target's own weights,
        # quantized, draft for it.
        own = args.speculative_model is None
        draft = DraftModelProposer(args.model if own else args.speculative_model, target_tokenizer=tokenizer,
                                   target_vocab_size=vocab_size, device=device, dtype=dtype,
                                   block_size=args.block_size, max_chunk_tokens=max_num_batched_tokens,
                                   revision=args.revision if own else None,
                                   tokenizer=args.tokenizer if own else None,
                                   quantization=args.speculative_quantization, activations=args.activations)
        ratio = draft.step_bytes / max(target_step_bytes, 1)
        cost = VERIFY_ROW_COST + max(DRAFT_STEP_FLOOR, ratio)
        return SpecDecoder(draft, cost_per_draft=cost, kv_bytes_per_block=draft.kv_bytes_per_block,
                           prior_acceptance=PRIOR_ACCEPTANCE["draft"], **common)
    raise ConfigError(f"speculative_method: {method!r} is not one of ngram, draft")
