"""Per-request parameters of a pooling request: one vector (or score) per prompt, no generation."""

from __future__ import annotations

from dataclasses import dataclass

from kvik.core.errors import InvalidRequestError

# What a model can be asked to do. "generate": sample tokens (chat, completions). "embed": the
# pooled hidden state as an embedding (/v1/embeddings). "classify": the pooled hidden state through
# the model's classification head (/classify; a reward model is a one-label classifier).
TASKS = ("generate", "embed", "classify")
POOLING_TASKS = ("embed", "classify")


@dataclass(slots=True)
class PoolingParams:
    """task: "embed" or "classify". dimensions: keep the first `dimensions` values of an embedding
    and renormalise (Matryoshka models only; the front end checks the model declares support)."""

    task: str = "embed"
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise InvalidRequestError(f"task: {self.task!r} is not a pooling task; use one of "
                                      f"{', '.join(POOLING_TASKS)}")
        if self.dimensions is not None and self.dimensions < 1:
            raise InvalidRequestError(f"dimensions: must be at least 1, got {self.dimensions}",
                                      param="dimensions")
