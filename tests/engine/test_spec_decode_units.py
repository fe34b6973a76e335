"""Speculative decoding, without a model: the accept/reject rule against exact distributions
(chi-square), the n-gram lookup, the adaptive k, and the scheduler's budget and rollback."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from scipy import stats

from kvik.core.sampling_params import SamplingParams
from kvik.engine.kv_manager import KVCacheManager
from kvik.engine.request import RequestStatus
from kvik.engine.scheduler import SampledTokens, Scheduler
from kvik.engine.spec_decode.adaptive import AdaptiveK, best_k
from kvik.engine.spec_decode.decoder import PRIOR_ACCEPTANCE, VERIFY_FIXED_COST, VERIFY_ROW_COST
from kvik.engine.spec_decode.ngram import NgramIndex
from kvik.engine.spec_decode.rejection import greedy_accept, speculative_sample
from tests.engine.helpers import make_request

VOCAB = 5
LENGTH = 3  # tokens generated per trial


@functools.lru_cache(maxsize=None)
def _distribution(prefix: tuple[int, ...], salt: int, sharpness: float) -> torch.Tensor:
    """A fixed, prefix-dependent next-token distribution over VOCAB tokens (a toy "model")."""
    generator = torch.Generator().manual_seed(hash((prefix, salt)) % 2**31)
    return torch.softmax(torch.randn(VOCAB, generator=generator, dtype=torch.float64) * sharpness, 0).float()


def target(prefix):
    return _distribution(prefix, 1, 1.5)


def draft(prefix):
    return _distribution(prefix, 2, 1.0)


def _generate(generator: torch.Generator, k: int, point_mass: bool) -> tuple[int, ...]:
    """LENGTH tokens by propose-then-verify rounds, as the engine runs them."""
    tokens: list[int] = []
    while len(tokens) < LENGTH:
        drafts, draft_rows = [], []
        for _ in range(min(k, LENGTH - len(tokens) - 1) or 1):
            if point_mass:  # a deterministic proposer: the draft's most likely token
                drafts.append(int(draft(tuple(tokens + drafts)).argmax()))
            else:
                row = draft(tuple(tokens + drafts))
                drafts.append(int(torch.multinomial(row, 1, generator=generator)))
                draft_rows.append(row)
        rows = torch.stack([target(tuple(tokens + drafts[:j])) for j in range(len(drafts) + 1)])
        out = speculative_sample(rows, drafts, None if point_mass else torch.stack(draft_rows), generator)
        tokens.extend(out)
    return tuple(tokens[:LENGTH])


@pytest.mark.parametrize("k,point_mass", [(2, False), (3, True)])
def test_speculative_sampling_keeps_the_target_distribution_of_whole_sequences(k, point_mass):
    """Chi-square of the joint distribution of 3 tokens (125 outcomes) against the exact one."""
    exact = {}
    for sequence in itertools.product(range(VOCAB), repeat=LENGTH):
        probability = 1.0
        for position in range(LENGTH):
            probability *= float(target(sequence[:position])[sequence[position]])
        exact[sequence] = probability
    generator = torch.Generator().manual_seed(0)
    draws = 4000
    counts = dict.fromkeys(exact, 0)
    for _ in range(draws):
        counts[_generate(generator, k, point_mass)] += 1
    expected = torch.tensor([exact[s] * draws for s in exact], dtype=torch.float64)
    observed = torch.tensor([counts[s] for s in exact], dtype=torch.float64)
    frequent = expected >= 5
    observed = torch.cat([observed[frequent], observed[~frequent].sum().unsqueeze(0)])
    expected = torch.cat([expected[frequent], expected[~frequent].sum().unsqueeze(0)])
    result = stats.chisquare(observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item())
    assert result.pvalue > 0.001, result


def test_speculative_sampling_accepts_drafts_at_the_rate_min_p_q():
    """The accept rule itself: a draft from q is kept with probability sum_x min(p(x), q(x))."""
    generator = torch.Generator().manual_seed(3)
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.2, 0.2, 0.4])
    trials, kept = 4000, 0
    for _ in range(trials):
        d = int(torch.multinomial(q, 1, generator=generator))
        out = speculative_sample(torch.stack([p, p]), [d], q[None], generator)
        kept += len(out) == 2
    expected = float(torch.minimum(p, q).sum())  # 0.6
    assert abs(kept / trials - expected) < 4 * (expected * (1 - expected) / trials) ** 0.5


def test_greedy_accepts_the_matching_prefix_and_adds_the_targets_token():
    assert greedy_accept([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]
    assert greedy_accept([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert greedy_accept([4, 6, 7, 8], [5, 6, 7]) == [4]


def test_ngram_lookup_copies_what_followed_the_latest_longest_match():
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3]
    # "1 2 3" occurred at the start (followed by 4 9); the 2-gram "2 3" later (followed by 5).
    assert index.lookup(tokens, 2) == [4, 9]
    tokens += [6]
    assert index.lookup(tokens, 3) == []  # 6 never occurred before
    index2 = NgramIndex(2, 2)
    # A repeating stretch: past the known tokens the copy continues with the same period.
    assert index2.lookup([8, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]


def test_adaptive_k_grows_with_acceptance_and_pauses_when_it_does_not_pay():
    assert best_k(0.9, 8, 0.05) == 8
    assert best_k(0.5, 8, 0.05) < best_k(0.8, 8, 0.05)
    assert best_k(0.04, 8, 0.05) == 0  # below the cost of one draft: off
    # A fixed cost per verification: low acceptance does not pay even for one draft.
    assert best_k(0.4, 3, 0.2, 0.3) == 0 and best_k(0.4, 3, 0.2, 0.0) > 0
    assert best_k(1.0, 3, 0.2, 0.3) == 3
    state = AdaptiveK(max_k=5, cost_per_draft=0.05)
    verifications = 0
    while not state.steps_off and verifications < 50:
        state.observe(state.next_k(), 0)
        verifications += 1
    assert verifications <= 15  # every draft rejected: off within a few steps
    # While off: no drafts until the probe, which proposes one.
    ks = [state.next_k() for _ in range(state.steps_off)]
    assert ks[:-1] == [0] * (len(ks) - 1) and ks[-1] == 1
    for _ in range(6):
        state.observe(1, 1)
    assert state.next_k() == 5
    assert AdaptiveK(max_k=3, cost_per_draft=0.05, enabled=False).next_k() == 3


def test_a_draft_model_starts_speculating_where_the_lookup_starts_off():
    """At a draft model's cost per draft (its step plus a verification row, ~0.5 of a target
    step for an int8 copy of the target), the lookup's doubtful prior keeps a new sequence off; a
    draft model's prior starts it at k > 0, and rejections still turn it off."""
    cost = VERIFY_ROW_COST + 0.27
    lookup = AdaptiveK.with_prior(3, cost, VERIFY_FIXED_COST, True, PRIOR_ACCEPTANCE["ngram"])
    draft = AdaptiveK.with_prior(3, cost, VERIFY_FIXED_COST, True, PRIOR_ACCEPTANCE["draft"])
    assert lookup.next_k() == 0
    assert draft.next_k() > 0
    for _ in range(10):
        if draft.steps_off:
            break
        draft.observe(draft.next_k(), 0)
    assert draft.steps_off > 0


# -- scheduler: drafts in the budget, rollback, prefix caching of accepted tokens only --

def _prefill(scheduler: Scheduler, request, next_token: int) -> None:
    """One step; the token is sampled if the step computed the whole prompt."""
    out = scheduler.schedule()
    done = out.chunks[0].completes_sequence
    scheduler.update_from_output(out, {request: SampledTokens([next_token])} if done else {})


def test_drafts_are_scheduled_in_the_budget_and_rejected_ones_rolled_back():
    kv = KVCacheManager(16, 4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=4)
    request = make_request([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=50, ignore_eos=True))
    scheduler.add(request)
    _prefill(scheduler, request, 7)  # budget 4: two chunks, then token 7
    _prefill(scheduler, request, 7)
    assert request.all_token_ids == [1, 2, 3, 4, 5, 6, 7] and request.num_computed_tokens == 6
    request.spec_token_ids = [8, 9, 10, 11, 12]
    out = scheduler.schedule()
    chunk = out.chunks[0]
    # 1 known token + 3 drafts fill the budget of 4; the last two drafts are dropped.
    assert (chunk.start, chunk.num_new_tokens, chunk.spec_token_ids) == (6, 4, [8, 9, 10])
    assert chunk.completes_sequence and chunk.token_at(7) == 8 and chunk.token_at(9) == 10
    assert len(kv.block_ids(request)) == 3  # positions 0..9
    # The target accepts 8, rejects 9 and samples 20 instead.
    outputs = scheduler.update_from_output(out, {request: SampledTokens([8, 20])})
    assert outputs[0].new_token_ids == [8, 20]
    assert request.all_token_ids[-3:] == [7, 8, 20]
    assert request.num_computed_tokens == 8  # 7 and 8 have KV; 20 is computed next step
    assert request.spec_token_ids == []
    # Only blocks of accepted tokens are in the prefix cache: positions 0..7 = two full blocks.
    assert len(kv.block_hashes[request.seq_id]) == 2
    assert len(kv.block_ids(request)) == 3  # the third block stays for reuse
    kv.pool.check_invariants()


def test_stop_inside_accepted_drafts_drops_the_rest():
    kv = KVCacheManager(16, 4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, eos_token_ids=frozenset({0}))
    request = make_request([1, 2, 3], SamplingParams(max_tokens=50))
    scheduler.add(request)
    _prefill(scheduler, request, 4)
    request.spec_token_ids = [5, 0, 6]
    out = scheduler.schedule()
    outputs = scheduler.update_from_output(out, {request: SampledTokens([5, 0, 6, 7])})
    assert outputs[0].new_token_ids == [5, 0] and outputs[0].finish_reason == "stop"
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert kv.num_free_blocks() == 16


def test_max_tokens_inside_accepted_drafts():
    scheduler = Scheduler(KVCacheManager(16, 4), max_num_seqs=4, max_num_batched_tokens=64)
    request = make_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    scheduler.add(request)
    _prefill(scheduler, request, 4)
    request.spec_token_ids = [5, 6, 7]
    out = scheduler.schedule()
    outputs = scheduler.update_from_output(out, {request: SampledTokens([5, 6, 7, 8])})
    assert outputs[0].new_token_ids == [5, 6] and outputs[0].finish_reason == "length"


def test_drafts_give_way_before_anyone_is_preempted():
    kv = KVCacheManager(4, 4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    first, second = make_request([1, 2, 3]), make_request([4, 5, 6])
    for request in (first, second):
        request.params = SamplingParams(max_tokens=50, ignore_eos=True)
        scheduler.add(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, {first: SampledTokens([7]), second: SampledTokens([8])})
    # One block each, two free; nine drafts (positions 4..12) would need three more.
    first.spec_token_ids = [9] * 9
    out = scheduler.schedule()
    assert out.preempted == []
    assert [(c.request, c.num_new_tokens, c.spec_token_ids) for c in out.chunks] == [
        (first, 1, []), (second, 1, [])]
