"""The proposer interface and the view of a sequence with drafts appended."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvik.core.sampling_params import SamplingParams
from kvik.engine.request import Request


@dataclass(slots=True)
class Draft:
    """Up to k proposed tokens for one sequence. `probs` (len(token_ids), V) holds the distribution
    each token was drawn from, or None when the proposer picks deterministically (a point mass)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[Draft | None]:
        """Drafts for each sequence (at most num_drafts[i] tokens; None or empty when there is
        nothing worth proposing). Called after a step, for sequences whose next step decodes."""
        ...


class DraftContext:
    """A sequence as if `extra` draft tokens had been appended: what the sampler's logit processors
    read (penalties and min_tokens depend on the tokens so far), built lazily."""

    __slots__ = ("request", "extra")

    def __init__(self, request: Request, extra: list[int]) -> None:
        self.request = request
        self.extra = extra

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def index(self) -> int:
        return self.request.index

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.all_token_ids + self.extra

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.extra

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.extra)
