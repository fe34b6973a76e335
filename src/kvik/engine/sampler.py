"""Batched sampling: logit processors, then greedy or random choice, and logprobs.

Order per row: logit bias, min_tokens (forbid end-of-sequence tokens), repetition penalty (prompt and
output tokens, HF's rule), presence and frequency penalties (output tokens, OpenAI's rule), the
grammar's token mask for constrained sequences (structured outputs), then greedy argmax or:
temperature, top-k, top-p, min-p, and a draw. Returned logprobs are those of the model's raw
distribution (log-softmax of the unprocessed logits), as vLLM and OpenAI report them: a constrained
token's logprob says how likely the model found it, not how likely the grammar left it.

A draw inverts the cumulative distribution: one uniform u per row, and the first token whose cumulative
probability (float64) exceeds u times the row's total, which picks token i with probability p_i. A
seeded request draws u from its own generator, one draw per step, so its tokens do not depend on
what else shares the batch. (An earlier draw, argmax(p / e) with e ~ Exp(1) per vocabulary entry,
spent 10.8 ms of a 16-row step generating 512,000 exponentials on the CPU; this one draws 16
numbers and adds up 512,000.)

Speculative decoding (kvik.engine.spec_decode) verifies draft tokens against the same distribution:
`processed` and `distribution` give it the rows this sampler would draw from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvik.engine.messages import TokenLogprobs
from kvik.engine.request import Request
from kvik.engine.structured.matcher import GrammarBackend
from kvik.model.layers.cpu_kernels import cpu_kernels


def inverse_cdf_draw(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """(R,) token ids: row i's first index whose cumulative weight exceeds uniforms[i] (in [0, 1))
    times the row's total, so index j comes with probability weights[i, j] / total. Sums in float64
    (a float32 running sum over a large vocabulary drifts by more than a small probability); a
    zero-weight entry adds nothing to the sum, so it can never be picked."""
    cumulative = weights.to(torch.float64).cumsum(dim=-1)
    targets = uniforms.to(torch.float64) * cumulative[:, -1]
    chosen = torch.searchsorted(cumulative, targets[:, None], right=True).squeeze(1)
    return chosen.clamp_(max=weights.shape[-1] - 1)  # u * total rounding up to total


# Candidate widths _filtered_probs tries before sorting the whole vocabulary.
_FILTER_WIDTHS = (256, 2048)


def _filter_sorted(values: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                   log_total: torch.Tensor | None, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k, then top-p and min-p on the renormalised top-k distribution, over `values`: each row's
    best logits, sorted descending; all of the row's vocabulary when `log_total` is None, else the
    best `width` of it, with `log_total` the logsumexp of the whole row. Returns the probabilities
    (0 where a filter removed the token; not renormalised) and, per row, whether they are exact:
    every token past the `width` given would have been removed too (always, for a whole row)."""
    width = values.shape[-1]
    ranks = torch.arange(width, device=values.device)[None, :]
    values = values.masked_fill(ranks >= top_k[:, None], float("-inf"))
    if log_total is None:
        probs = values.softmax(dim=-1)
    else:
        # The softmax runs over the top-k tokens where top-k cuts inside the width, else over the
        # whole row (its log-normaliser from log_total).
        log_norm = torch.where(top_k <= width, values.logsumexp(dim=-1), log_total)
        probs = (values - log_norm[:, None]).exp()
    mass = probs.cumsum(dim=-1)
    remove = (mass - probs) > top_p[:, None]
    remove |= probs < min_p[:, None] * probs[:, :1]
    remove[:, 0] = False  # the most likely token always survives
    if log_total is None:
        covered = torch.ones_like(remove[:, 0])
    else:
        # A token past the width has mass before it of at least mass[:, -1] and a probability of at
        # most probs[:, -1]: top-p removes it when mass[:, -1] > top_p, min-p when probs[:, -1] <
        # min_p * max. A top-k past the width renormalises over tokens this view does not hold.
        covered = (top_k <= width) | (mass[:, -1] > top_p) | (probs[:, -1] < min_p * probs[:, 0])
        covered &= (top_k <= width) | (top_k >= vocab)
    return probs.masked_fill(remove, 0.0), covered


# Bins _nucleus_without_sort spreads a row's logits over, from its largest down (at most 40 nats).
_NUCLEUS_BINS = 2048
_NUCLEUS_SPAN = 40.0
_NUCLEUS_MAX_SORTED = 4096  # boundary tokens past which a row is sorted whole


def _nucleus_without_sort(logits: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                          log_total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p and min-p over whole rows without top-k, without sorting them: what `_filter_sorted`
    keeps of a fully sorted row (probabilities in vocabulary order, 0 where removed). A token is
    kept by top-p when the mass of the tokens before it in descending order is at most top_p.

    Each row's logits go into bins of equal width below its largest (the last bin takes everything
    further down); the mass per bin, summed from the top, finds the one bin where that mass passes
    top_p. Tokens in earlier bins are kept, in later ones removed, and only the boundary bin's
    tokens are sorted. The mass runs in float64 across the bins and through the boundary bin (each
    bin's own total is a float32 sum of its few tokens), so the cut falls where a float64 sort puts
    it on every row the tests try, where the float32 running sum of `_filter_sorted` can move it by
    a token on a flat row of 32000. Returns the probabilities and which rows the bins split: a row
    with more than _NUCLEUS_MAX_SORTED tokens in its boundary bin (logits all equal, or nearly) is
    left to the caller's sort. Both filters keep the most likely token by construction (its mass
    before is 0; min_p <= 1)."""
    rows, last = logits.shape[0], _NUCLEUS_BINS - 1
    probs = (logits - log_total[:, None]).exp()
    top = logits.max(dim=-1, keepdim=True).values
    # The bins span the row's logits, at most _NUCLEUS_SPAN nats (a row with -inf in it: all of them).
    span = (top - logits.min(dim=-1, keepdim=True).values).clamp(max=_NUCLEUS_SPAN)
    width = (span / last).clamp(min=1e-30)
    bins = ((top - logits) / width).nan_to_num(nan=last, posinf=last).clamp_(0, last).long()
    mass = torch.zeros(rows, _NUCLEUS_BINS, dtype=probs.dtype, device=logits.device)
    mass = mass.scatter_add_(1, bins, probs).double()
    through = mass.cumsum(dim=-1)
    # The boundary bin: the first whose mass, with all before it, passes top_p (the last if none).
    boundary = (through <= top_p.double()[:, None]).sum(dim=-1).clamp(max=last)
    before = (through - mass).gather(1, boundary[:, None]).squeeze(1)
    remove = bins > boundary[:, None]
    members = bins == boundary[:, None]
    split = members.sum(dim=-1) <= _NUCLEUS_MAX_SORTED
    members &= split[:, None]
    # The boundary bins' tokens, all rows at once: by row, then by logit descending (not by
    # probability: on a flat row of 32000, distinct logits often round to one float32 probability).
    at_row, at_col = members.nonzero(as_tuple=True)
    order = logits[at_row, at_col].argsort(descending=True, stable=True)
    order = order[at_row[order].argsort(stable=True)]
    at_row, at_col = at_row[order], at_col[order]
    if len(at_row):  # none where top_p >= the whole row's mass (the boundary is then an empty last bin)
        values = probs[at_row, at_col].double()
        running = values.cumsum(dim=0) - values  # mass before each token, from the first boundary token
        counts = torch.bincount(at_row, minlength=rows)
        row_base = running[(counts.cumsum(dim=0) - counts).clamp(max=len(running) - 1)]
        mass_before = before[at_row] + running - row_base[at_row]
        cut = mass_before > top_p.double()[at_row]
        remove[at_row[cut], at_col[cut]] = True
    if bool((min_p > 0).any()):
        remove |= probs < min_p[:, None] * (top - log_total[:, None]).exp()
    return probs.masked_fill(remove, 0.0), split


def argmax_rows(values: torch.Tensor) -> torch.Tensor:
    """values.argmax(dim=-1) for (R, V) rows. Float32 rows on the CPU go to kvik's kernel: PyTorch's
    CPU argmax walks a row one element at a time (55 us for one 32000-entry row, 1.1-1.7 ms for 16
    rows on the 2-core AVX-512 machine, a few percent of a decode step). Same answer: the first
    index of the largest value, or of the first NaN."""
    if values.device.type == "cpu" and values.dtype == torch.float32 and values.dim() == 2 and values.shape[1]:
        kernels = cpu_kernels()
        if kernels is not None:
            return kernels.argmax_rows(values.contiguous())
    return values.argmax(dim=-1)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row: the chosen token's logprob and the top-k alternatives, or None if not asked for.
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: list[int], device: torch.device,
                 seed: int = 0, grammars: GrammarBackend | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.grammars = grammars

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits: (R, V) float32, row i for requests[i]."""
        rows = len(requests)
        if rows == 0:
            return SamplerOutput([], [])
        want_logprobs = [r.params.logprobs is not None for r in requests]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        processed = self._process(logits, requests)
        constrained = [i for i, r in enumerate(requests) if r.grammar is not None and r.grammar.active]
        if constrained:
            if processed is logits:
                processed = logits.clone()
            self.grammars.apply_masks(processed, constrained, [requests[i].grammar for i in constrained])
            self._reopen_end_of_sequence(processed, logits, [requests[i] for i in constrained], constrained)

        greedy = [i for i, r in enumerate(requests) if r.params.greedy]
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
        # All greedy (single-stream decoding, mostly) or all sampled: no row gathers.
        if not sampled:
            chosen = argmax_rows(processed)
        elif not greedy:
            chosen = self._draw(processed, requests)
        else:
            chosen = torch.empty(rows, dtype=torch.long, device=logits.device)
            index = torch.tensor(greedy, device=logits.device)
            chosen[index] = argmax_rows(processed[index])
            index = torch.tensor(sampled, device=logits.device)
            chosen[index] = self._draw(processed[index], [requests[i] for i in sampled])
        token_ids = chosen.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * rows
        if raw_logprobs is not None:
            self._gather_logprobs(raw_logprobs, chosen, requests, want_logprobs, logprobs)
        return SamplerOutput(token_ids, logprobs)

    def processed(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """`logits` (R, V) after the logit processors. Row i is processed for requests[i], which may
        be any object with a Request's `params`, `all_token_ids`, `output_token_ids` and
        `num_output_tokens` (a verifier scores rows as if draft tokens were already appended)."""
        return self._process(logits, requests)

    def distribution(self, processed: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """(R, V) probabilities a random draw for each row follows: temperature, top-k, top-p and
        min-p applied to processed logits. Rows of greedy requests are not meaningful."""
        probs = self._filtered_probs(processed, requests)
        return probs / probs.sum(dim=-1, keepdim=True)  # the filters zero entries without rescaling

    # -- logit processors --

    def _process(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        vocab = logits.shape[-1]
        processed = logits
        for row, request in enumerate(requests):
            params = request.params
            needs = (params.logit_bias or params.min_tokens or params.repetition_penalty != 1.0
                     or params.presence_penalty or params.frequency_penalty)
            if not needs:
                continue
            if processed is logits:
                processed = logits.clone()
            values = processed[row]
            if params.logit_bias:
                ids = [t for t in params.logit_bias if 0 <= t < vocab]
                if ids:
                    bias = torch.tensor([params.logit_bias[t] for t in ids], device=values.device)
                    values[torch.tensor(ids, device=values.device)] += bias
            if request.num_output_tokens < params.min_tokens:
                banned = list(params.stop_token_ids)
                if not params.ignore_eos:
                    banned += self.eos_token_ids
                banned = [t for t in banned if 0 <= t < vocab]
                if banned:
                    values[torch.tensor(banned, device=values.device)] = float("-inf")
            if params.repetition_penalty != 1.0:
                seen = torch.tensor(request.all_token_ids, device=values.device).unique()
                scores = values[seen]
                penalty = params.repetition_penalty
                values[seen] = torch.where(scores > 0, scores / penalty, scores * penalty)
            if (params.presence_penalty or params.frequency_penalty) and request.num_output_tokens:
                outputs = torch.tensor(request.output_token_ids, device=values.device)
                counts = torch.bincount(outputs, minlength=vocab)[:vocab].to(values.dtype)
                values -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        return processed

    def _reopen_end_of_sequence(self, processed: torch.Tensor, logits: torch.Tensor,
                                requests: list[Request], rows: list[int]) -> None:
        """A grammar that is complete allows only the end of sequence, which min_tokens forbids:
        such a row has no token left. The grammar wins; its end-of-sequence logits come back."""
        for row, request in zip(rows, requests):
            if request.num_output_tokens >= request.params.min_tokens:
                continue
            if bool(torch.isinf(processed[row]).all()):
                eos = torch.tensor([t for t in self.eos_token_ids if 0 <= t < processed.shape[-1]],
                                   device=processed.device)
                processed[row, eos] = logits[row, eos]

    # -- random draw with temperature, top-k, top-p, min-p --

    def _draw(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        probs = self._filtered_probs(logits, requests)
        device = probs.device
        uniforms = torch.empty(len(requests), dtype=torch.float64, device=device)
        unseeded = [i for i, r in enumerate(requests) if r.params.seed is None]
        if unseeded:
            uniforms[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, device=device,
                                            generator=self.generator)
        for i, request in enumerate(requests):
            if request.params.seed is not None:
                uniforms[i] = torch.rand(1, dtype=torch.float64, device=device,
                                         generator=self.generator_for(request))[0]
        return inverse_cdf_draw(probs, uniforms)

    def generator_for(self, request: Request) -> torch.Generator:
        """The request's own generator if it has a seed (created on first use), else the shared one."""
        if request.params.seed is None:
            return self.generator
        if request.generator is None:
            request.generator = torch.Generator(device=self.device).manual_seed(
                request.params.seed + request.index)
        return request.generator

    def _filtered_probs(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Probabilities in vocabulary order after temperature, top-k, top-p and min-p (0 where a
        filter removed the token; not renormalised). The draw inverts their running sum in this
        order, so a seeded row's token depends only on its own logits and its own uniform."""
        device = logits.device
        temperature = torch.tensor([r.params.temperature for r in requests], device=device)
        logits = logits / temperature[:, None]
        vocab = logits.shape[-1]
        top_k = torch.tensor([r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in requests],
                             device=device)
        top_p = torch.tensor([r.params.top_p for r in requests], device=device)
        min_p = torch.tensor([r.params.min_p for r in requests], device=device)
        remaining = ((top_k < vocab) | (top_p < 1.0) | (min_p > 0)).nonzero().squeeze(1)
        # Rows without a filter take the plain softmax; the filtered ones are written whole below.
        probs = logits.softmax(dim=-1) if len(remaining) < len(requests) else torch.empty_like(logits)
        # The filters need the tokens in order of probability. A full sort of the vocabulary
        # (PyTorch's CPU sort: 1.1 ms a row at 32000 tokens) is only needed where they keep most of
        # it; usually they keep a few, so each row first tries its best 256 tokens (topk: 0.1 ms a
        # row), then 2048, then the whole row, and stops at the first width that holds everything it
        # keeps; a whole row without top-k is binned rather than sorted (_nucleus_without_sort).
        # Which width a row takes depends on that row alone.
        log_total = logits.logsumexp(dim=-1) if len(remaining) else None
        for width in (*(w for w in _FILTER_WIDTHS if w < vocab), vocab):
            if len(remaining) == 0:
                break
            if width == vocab:
                # What the widths did not cover: without top-k, bins instead of a sort of the row.
                binnable = remaining[top_k[remaining] >= vocab]
                if len(binnable):
                    binned, split = _nucleus_without_sort(logits[binnable], top_p[binnable],
                                                          min_p[binnable], log_total[binnable])
                    probs[binnable[split]] = binned[split]
                    remaining = remaining[~torch.isin(remaining, binnable[split])]
                    if len(remaining) == 0:
                        break
            rows = logits[remaining]
            values, order = rows.sort(dim=-1, descending=True) if width == vocab else rows.topk(width, dim=-1)
            kept, covered = _filter_sorted(values, top_k[remaining], top_p[remaining], min_p[remaining],
                                           None if width == vocab else log_total[remaining], vocab)
            done = covered.nonzero().squeeze(1)
            probs[remaining[done]] = torch.zeros_like(probs[remaining[done]]).scatter_(1, order[done], kept[done])
            remaining = remaining[~covered]
        return probs

    # -- logprobs --

    @staticmethod
    def _gather_logprobs(raw: torch.Tensor, chosen: torch.Tensor, requests: list[Request],
                         wanted: list[bool], out: list[TokenLogprobs | None]) -> None:
        rows = [i for i, w in enumerate(wanted) if w]
        index = torch.tensor(rows, device=raw.device)
        ks = [requests[i].params.logprobs for i in rows]
        for j, entry in enumerate(_logprob_entries(raw[index], chosen[index], ks)):
            out[rows[j]] = entry


def _logprob_entries(lp: torch.Tensor, targets: torch.Tensor, ks: list[int]) -> list[TokenLogprobs]:
    """lp: (R, V) log-probabilities; targets: (R,) the token each row scores; ks: alternatives per
    row. Each entry lists the target first, then the top-k tokens not already listed."""
    target_lp = lp.gather(1, targets[:, None]).squeeze(1)
    ranks = ((lp > target_lp[:, None]).sum(dim=-1) + 1).tolist()
    max_k = max(ks, default=0)
    top_v, top_i = (lp.topk(max_k, dim=-1) if max_k else (None, None))
    top_v = top_v.tolist() if max_k else None
    top_i = top_i.tolist() if max_k else None
    entries = []
    for j, (token, value) in enumerate(zip(targets.tolist(), target_lp.tolist())):
        ids, values, entry_ranks = [token], [value], [ranks[j]]
        for rank in range(ks[j]):
            alternative = top_i[j][rank]
            if alternative != token:
                ids.append(alternative)
                values.append(top_v[j][rank])
                entry_ranks.append(rank + 1)
        entries.append(TokenLogprobs(ids, values, entry_ranks))
    return entries


def prompt_logprobs_for(raw_logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """Logprob entries for prompt tokens: row i of `raw_logits` scores `targets[i]`."""
    lp = torch.log_softmax(raw_logits, dim=-1)
    target = torch.tensor(targets, device=lp.device)
    return _logprob_entries(lp, target, [k] * len(targets))
