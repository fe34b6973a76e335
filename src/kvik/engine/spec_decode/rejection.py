"""Which draft tokens the target keeps, and the one token it adds.

Greedy requests keep drafts while they equal the target's argmax, then take the argmax. Sampled
requests use speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023): draft i, drawn from q_i, is kept with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is drawn from the residual
max(0, p_i - q_i), renormalised; if every draft is kept, one more token is drawn from p_k. Each
output token then follows the target's distribution p exactly, whatever q is. A proposer that picks
deterministically (n-gram lookup) is a point mass q = 1 at its token: the draft is kept with
probability p(d), and the residual is p with d removed.
"""

from __future__ import annotations

import torch

from kvik.engine.sampler import inverse_cdf_draw


def greedy_accept(target_token_ids: list[int], draft_token_ids: list[int]) -> list[int]:
    """target_token_ids: the target's argmax after the known tokens and after each draft (k + 1).
    Returns the drafts that equal it, then the target's token at the first difference."""
    accepted = 0
    while accepted < len(draft_token_ids) and draft_token_ids[accepted] == target_token_ids[accepted]:
        accepted += 1
    return target_token_ids[:accepted + 1]


def speculative_sample(target_probs: torch.Tensor, draft_token_ids: list[int],
                       draft_probs: torch.Tensor | None, generator: torch.Generator) -> list[int]:
    """target_probs: (k + 1, V), row i the target's distribution after the known tokens and i
    drafts; draft_probs: (k, V) the distributions the drafts were drawn from, or None for point
    masses. Returns the accepted drafts followed by one token drawn by the target."""
    k = len(draft_token_ids)
    device = target_probs.device
    drafts = torch.tensor(draft_token_ids, device=device)
    p = target_probs[:k].gather(1, drafts[:, None]).squeeze(1)  # (k,) p_i(d_i)
    q = (draft_probs.gather(1, drafts[:, None]).squeeze(1) if draft_probs is not None
         else torch.ones(k, device=device))
    uniform = torch.rand(k, device=device, generator=generator)
    rejected = (uniform * q >= p).tolist()  # keep d_i when u < p / q
    accepted = rejected.index(True) if True in rejected else k
    if accepted == k:
        return draft_token_ids + [draw_token(target_probs[k], generator)]
    residual = target_probs[accepted].clone()
    if draft_probs is None:
        residual[draft_token_ids[accepted]] = 0.0
    else:
        residual = (residual - draft_probs[accepted]).clamp_min_(0.0)
    if not residual.sum() > 0:  # p == q up to rounding: rejection had probability ~0
        residual = target_probs[accepted]
    return draft_token_ids[:accepted] + [draw_token(residual, generator)]


def draw_token(weights: torch.Tensor, generator: torch.Generator) -> int:
    """A token with probability proportional to `weights` (V,), by the sampler's own rule (one
    uniform from `generator`, inverted through the cumulative weights)."""
    uniform = torch.rand(1, dtype=torch.float64, device=weights.device, generator=generator)
    return int(inverse_cdf_draw(weights[None], uniform)[0])
