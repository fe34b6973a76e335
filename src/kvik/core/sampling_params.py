"""Per-request sampling parameters, shaped like vLLM's so users feel at home."""

from __future__ import annotations

import enum
import json as jsonlib
from dataclasses import dataclass, field
from typing import Any

from kvik.core.errors import InvalidRequestError

# Past this many alternatives the top-k gather dominates a decode step; OpenAI caps at 20.
MAX_LOGPROBS = 20


class OutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # every output carries the whole text so far
    DELTA = "delta"  # every output carries only what is new since the last one (streaming)
    FINAL_ONLY = "final_only"  # one output, when the request finishes


@dataclass(slots=True)
class StructuredOutputs:
    """A constraint on the output, enforced token by token by the engine's grammar engine (vLLM's
    `StructuredOutputsParams`). Exactly one of `json` (a JSON schema, as a dict or JSON text),
    `json_object` (any JSON object), `regex` (the whole output matches it), `choice` (the output is
    one of the strings) or `grammar` (Lark, llguidance's dialect, or GBNF) is set.

    `start_after_token_id`: the constraint applies only after this token was generated (the end of
    a reasoning model's thinking, `</think>`); None constrains from the first token. The front end
    sets it; the output must end with an end-of-sequence token the grammar allows when complete.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    start_after_token_id: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            self.json = jsonlib.dumps(self.json)  # property order is kept: it is the output's order
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs: give exactly one of json, json_object, regex, choice, grammar"
                + (f" (got {', '.join(given)})" if given else ""), param="structured_outputs")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise InvalidRequestError("structured_outputs.choice: must be a non-empty list of strings",
                                      param="structured_outputs")

    @property
    def kind(self) -> str:
        """Which constraint this is: json, json_object, regex, choice or grammar."""
        if self.json_object:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens for one request.

    temperature 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those filters.
    `seed` makes a request reproducible whatever else shares its batch. `logprobs=k` returns the
    sampled token's logprob plus the top k alternatives at each step; `prompt_logprobs=k` the same for
    every prompt token (the first has none). `stop` strings are cut from the text unless
    `include_stop_str_in_output`. `max_tokens=None` means up to the context length.
    `structured_outputs` constrains the output to a JSON schema, regex, choice or grammar.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: OutputKind = OutputKind.CUMULATIVE
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self.validate()

    def validate(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param}: {message}", param=param)

        if self.n < 1:
            raise bad("n", f"must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise bad("top_k", f"must be -1 or 0 (disabled) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"{self.min_tokens} exceeds max_tokens {self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise bad(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "token ids must be >= 0")
        if self.logit_bias and any(not -100 <= v <= 100 for v in self.logit_bias.values()):
            raise bad("logit_bias", "bias values must be in [-100, 100]")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise bad("seed", "must fit in a signed 64-bit integer")
        if self.structured_outputs is not None and self.ignore_eos:
            # A finished grammar allows only the end of sequence; ignoring it leaves no valid token.
            raise bad("ignore_eos", "cannot be combined with structured outputs")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self, **changes: object) -> SamplingParams:
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        values.update(changes)
        values["stop"] = list(values["stop"])
        values["stop_token_ids"] = list(values["stop_token_ids"])
        return SamplingParams(**values)
