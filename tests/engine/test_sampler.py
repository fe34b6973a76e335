"""Sampler: seeded reproducibility whatever the batch, sampled frequencies against the target
distribution (chi-square), and each logit processor against its formula."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from kvik import LLM, SamplingParams
from kvik.engine.sampler import Sampler, _nucleus_without_sort, argmax_rows, inverse_cdf_draw
from tests.engine.helpers import make_request

VOCAB = 50


def target_distribution(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0,
                        min_p: float = 0.0) -> torch.Tensor:
    """Written independently of the sampler: the distribution its draws must follow."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = torch.argsort(probs, descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for rank, token in enumerate(order.tolist()):
        if top_k and rank >= top_k:
            break
        if not top_k and rank > 0 and mass > top_p:  # with top-k, top-p cuts below instead
            break
        keep[token] = True
        mass += probs[token].item()
    if top_k:  # top-p applies to the top-k renormalised distribution
        sub = probs * keep
        sub = sub / sub.sum()
        keep = torch.zeros_like(keep)
        mass = 0.0
        for rank, token in enumerate(torch.argsort(sub, descending=True).tolist()):
            if rank > 0 and mass > top_p:
                break
            keep[token] = True
            mass += sub[token].item()
        probs = sub
    if min_p:
        keep &= probs >= min_p * probs[keep].max()
    target = probs * keep
    return target / target.sum()


@pytest.mark.parametrize("temperature,top_p,top_k,min_p", [
    (0.8, 0.9, 0, 0.0), (1.0, 1.0, 0, 0.0), (1.3, 1.0, 5, 0.0), (1.0, 0.95, 0, 0.05)])
def test_sampled_frequencies_follow_the_target_distribution(temperature, top_p, top_k, min_p):
    generator = torch.Generator().manual_seed(1234)
    logits = torch.randn(VOCAB, generator=generator) * 2
    draws = 6000
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    requests = [make_request([1], params) for _ in range(draws)]
    sampler = Sampler(VOCAB, [], torch.device("cpu"), seed=7)
    tokens = sampler(logits.repeat(draws, 1), requests).token_ids
    target = target_distribution(logits, temperature, top_p, top_k, min_p)
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    assert counts[target == 0].sum() == 0, "sampled a token the filters remove"
    # Pool the rare tokens into one bin so every expected count is at least 5.
    expected = target * draws
    frequent = expected >= 5
    observed = torch.cat([counts[frequent], counts[~frequent].sum().unsqueeze(0)])
    expect = torch.cat([expected[frequent], expected[~frequent].sum().unsqueeze(0)])
    if expect[-1] == 0:
        observed, expect = observed[:-1], expect[:-1]
    result = stats.chisquare(observed.numpy(), expect.numpy())
    assert result.pvalue > 0.001, result


def test_filters_on_a_large_vocabulary_match_the_written_out_distribution():
    """With 5000 tokens the filters take their best 256 or 2048 tokens where those hold everything
    they keep, and sort the whole row otherwise: rows of each kind, and an unfiltered one, in one
    batch, each against target_distribution and against the same row alone."""
    vocab = 5000
    generator = torch.Generator().manual_seed(5)
    base = torch.randn(vocab, generator=generator)
    rows = [  # (logit scale, temperature, top_p, top_k, min_p): the width each needs
        (8.0, 0.8, 0.9, 0, 0.0),      # peaked: 256
        (2.2, 1.0, 0.9, 0, 0.0),      # broader: 2048
        (0.1, 1.0, 0.9, 0, 0.0),      # nearly flat: the full sort
        (0.3, 1.0, 1.0, 10, 0.0),     # top-k inside 256
        (6.0, 1.0, 0.5, 3000, 0.0),   # top-k past 2048, cut by top-p
        (6.0, 1.0, 1.0, 0, 0.05),     # min-p alone
        (0.1, 1.0, 1.0, 0, 0.5),      # min-p keeping most of a flat row: the full sort
        (1.0, 1.0, 1.0, 0, 0.0),      # no filter
    ]
    logits = torch.stack([base * scale for scale, *_ in rows])
    requests = [make_request([1], SamplingParams(temperature=t, top_p=p, top_k=k, min_p=m))
                for _, t, p, k, m in rows]
    sampler = Sampler(vocab, [], torch.device("cpu"))
    together = sampler.distribution(logits, requests)
    assert together.shape == (len(rows), vocab)
    for i, (_, temperature, top_p, top_k, min_p) in enumerate(rows):
        expected = target_distribution(logits[i], temperature, top_p, top_k, min_p).float()
        assert torch.allclose(together[i], expected, atol=1e-6), i
        alone = sampler.distribution(logits[i:i + 1], [requests[i]])[0]
        assert torch.equal(alone, together[i]), i
    kept = (together > 0).sum(dim=-1).tolist()
    assert kept[0] <= 256 < kept[1] <= 2048 < kept[2] and kept[3] == 10 and kept[7] == vocab


def exact_nucleus(logits: torch.Tensor, top_p: float, min_p: float) -> torch.Tensor:
    """Which tokens top-p then min-p keep of one row, in float64 over a full sort."""
    probs = torch.softmax(logits.double(), dim=-1)
    values, order = probs.sort(descending=True)
    keep = (values.cumsum(dim=0) - values) <= top_p
    keep[0] = True
    kept = torch.zeros_like(probs, dtype=torch.bool).scatter_(0, order, keep)
    return kept & (probs >= min_p * probs.max())


@pytest.mark.parametrize("vocab", [5000, 32000])
def test_nucleus_without_sort_keeps_what_a_full_sort_keeps(vocab):
    """Rows no top-k cuts and the first 2048 tokens do not cover are binned, not sorted: the same
    tokens as a float64 sort keeps, with their softmax probabilities, over rows of every shape
    (flat, peaked, masked to -inf, spanning more than the bins' 40 nats). A row of equal logits,
    which bins cannot split, is left to the Sampler's sort."""
    generator = torch.Generator().manual_seed(11)
    base = torch.randn(vocab, generator=generator)
    masked = base.clone()
    masked[::2] = float("-inf")  # a grammar's mask
    wide = base.clone()
    wide[:100] = -100.0  # far below everything else: past the bins' span
    flat = torch.zeros(vocab)
    rows = [base * 0.05, base * 0.5, base * 3.0, masked, wide, flat]
    cases = [(row, top_p, min_p) for row in rows for top_p, min_p in
             [(0.1, 0.0), (0.9, 0.0), (0.99, 0.0), (1.0, 0.3), (0.95, 0.05)]]
    logits = torch.stack([row for row, _, _ in cases])
    top_p = torch.tensor([p for _, p, _ in cases])
    min_p = torch.tensor([m for _, _, m in cases])
    got, split = _nucleus_without_sort(logits, top_p, min_p, logits.logsumexp(dim=-1))
    softmax = logits.softmax(dim=-1)
    for i, (row, p, m) in enumerate(cases):
        expected = exact_nucleus(row, p, m)
        kept = got[i] > 0
        if row is flat:  # all in one bin: left to the sort (at top_p 1 the bin may be past the cut)
            assert not split[i] if p < 1.0 else (not split[i] or torch.equal(kept, expected)), i
            continue
        assert split[i], i
        assert torch.equal(kept, expected), (i, (kept ^ expected).sum())
        assert torch.allclose(got[i][kept], softmax[i][kept]), i
    # The Sampler sorts what the bins leave: the same count as the float64 sort, within rounding.
    sampler = Sampler(vocab, [], torch.device("cpu"))
    request = make_request([1], SamplingParams(temperature=1.0, top_p=0.9))
    sorted_flat = sampler.distribution(flat[None], [request])[0]
    assert abs(int((sorted_flat > 0).sum()) - int(exact_nucleus(flat, 0.9, 0.0).sum())) <= 2
    # Batched as alone (the equal-logit rows among the binned ones): a row's result depends on
    # that row only.
    for i in range(len(cases)):
        alone, alone_split = _nucleus_without_sort(logits[i:i + 1], top_p[i:i + 1], min_p[i:i + 1],
                                                   logits[i:i + 1].logsumexp(dim=-1))
        assert bool(alone_split[0]) == bool(split[i]) and torch.equal(alone[0], got[i]), i


def test_greedy_takes_argmax_after_processors():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    sampler = Sampler(3, [], torch.device("cpu"))
    assert sampler(logits, [make_request([0], SamplingParams(temperature=0))]).token_ids == [1]
    biased = SamplingParams(temperature=0, logit_bias={2: 5.0})
    assert sampler(logits, [make_request([0], biased)]).token_ids == [2]


def test_argmax_rows_agrees_with_torch_on_every_path(monkeypatch):
    """The kernel for float32 CPU rows, PyTorch's argmax for anything else or without the kernels."""
    values = torch.randn(3, 40)
    values[1, 7] = values[1, 30] = 9.0  # a tie: the first index
    expected = values.argmax(dim=-1)
    assert torch.equal(argmax_rows(values), expected)
    assert torch.equal(argmax_rows(values.double()), expected)
    assert torch.equal(argmax_rows(values.t().contiguous().t()), expected)  # not contiguous
    monkeypatch.setattr("kvik.engine.sampler.cpu_kernels", lambda: None)
    assert torch.equal(argmax_rows(values), expected)


def test_inverse_cdf_draw_picks_by_cumulative_weight_and_never_a_zero():
    weights = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0]] * 6)
    uniforms = torch.tensor([0.0, 0.2499, 0.25, 0.7499, 0.75, 1.0 - 2**-53], dtype=torch.float64)
    assert inverse_cdf_draw(weights, uniforms).tolist() == [1, 1, 3, 3, 4, 4]
    # Unnormalised weights (the spec-decode residual) and a long row of tiny weights after a big one:
    # float64 sums keep each tiny weight's share.
    row = torch.full((1, 40000), 1e-9)
    row[0, 0] = 1.0
    total = float(row.double().cumsum(dim=-1)[0, -1])  # the sum the draw scales u by
    assert inverse_cdf_draw(row, torch.tensor([1.0 / total - 1e-12], dtype=torch.float64)).item() == 0
    assert inverse_cdf_draw(row, torch.tensor([(1.0 + 2.5e-9) / total], dtype=torch.float64)).item() == 3


def test_a_batch_of_greedy_and_sampled_rows_gives_each_its_own_rule():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 300, generator=generator) * 4
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=3, seed=9)
    requests = [make_request([1], p) for p in (greedy, sampled, greedy, sampled)]
    tokens = Sampler(300, [], torch.device("cpu"))(logits, requests).token_ids
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    for row in (1, 3):
        assert tokens[row] in logits[row].topk(3).indices.tolist()


def test_penalties_follow_their_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, 3.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    request = make_request([0, 1], params, outputs=[2, 2, 3])
    processed = Sampler(5, [], torch.device("cpu"))._process(logits, [request])[0]
    expected = torch.tensor([
        2.0 / 2,  # prompt token, positive: divided
        -1.0 * 2,  # prompt token, negative: multiplied
        0.5 / 2 - (0.25 * 2 + 0.5),  # output twice
        1.0 / 2 - (0.25 * 1 + 0.5),  # output once
        3.0,  # unseen
    ])
    assert torch.allclose(processed, expected)
    assert logits[0, 0] == 2.0, "the raw logits stay untouched for logprobs"


def test_min_tokens_forbids_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    sampler = Sampler(4, eos_token_ids=[1], device=torch.device("cpu"))
    assert sampler(logits, [make_request([0], params, outputs=[3])]).token_ids == [3]
    assert sampler(logits, [make_request([0], params, outputs=[3, 3])]).token_ids == [1]


def test_logprobs_report_raw_distribution_with_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    params = SamplingParams(temperature=0, logprobs=2, logit_bias={3: 10.0})
    out = Sampler(4, [], torch.device("cpu"))(logits, [make_request([0], params)])
    raw = torch.log_softmax(logits[0], -1)
    entry = out.logprobs[0]
    assert out.token_ids == [3]
    # The chosen token first, then the top-2 alternatives of the raw distribution.
    assert entry.token_ids == [3, 1, 2] and entry.ranks == [4, 1, 2]
    assert abs(entry.logprobs[0] - raw[3].item()) < 1e-6


def test_seeded_requests_ignore_batch_composition(tiny_llama):
    llm = LLM(str(tiny_llama), show_progress=False)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=16, ignore_eos=True)
    alone = llm.generate(["The moon rose"], seeded)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.2, max_tokens=24, ignore_eos=True)
    batch = llm.generate(["Hello there", "The moon rose", "a", "Numbers matter: 1, 2, 3"],
                         [noise, seeded, noise, noise])
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate(["x y z", "The moon rose"], [noise, seeded])
    assert again[1].outputs[0].token_ids == alone
    other_seed = llm.generate(["The moon rose"], seeded.clone(seed=43))[0].outputs[0].token_ids
    assert other_seed != alone


def test_n_choices_share_prompt_blocks_and_differ(tiny_llama):
    llm = LLM(str(tiny_llama), show_progress=False, block_size=4)
    prompt = "Once upon a time there was a small village by the sea, where the bakers rose"
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    output = llm.generate([prompt], params)[0]
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    prompt_len = len(output.prompt_token_ids)
    # Siblings 1 and 2 found the prompt's full blocks in the cache.
    assert llm.engine.core.kv.prefix_cache_hits >= 2 * ((prompt_len - 1) // 4) * 4
    assert llm.generate([prompt], params)[0].outputs[1].token_ids == output.outputs[1].token_ids
