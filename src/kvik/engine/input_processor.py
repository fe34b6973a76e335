"""The front end's half of admission: a prompt becomes a validated `EngineCoreRequest`, once.

Every check that depends on the model lives here, for the offline `LLM` and the server alike: the
prompt is not empty, its token ids are in the vocabulary, it leaves room in the context, the
output budget fits, and a structured-output constraint is one the grammar engine can enforce. The
server's messages follow OpenAI's wording, since its clients parse them. A request the model cannot
serve (chat to an embedding model, embeddings from a classifier) is a 400 here, naming what the
model does instead.
"""

from __future__ import annotations

from typing import Any

from kvik.core.errors import ContextLengthExceededError, InvalidRequestError
from kvik.core.pooling_params import PoolingParams
from kvik.core.sampling_params import OutputKind, SamplingParams
from kvik.core.tokenizer import Tokenizer
from kvik.engine.messages import EngineCoreRequest, EngineInfo
from kvik.engine.structured.grammar import check_constraint

# What each task is called for in the messages, so a user knows which endpoint to use instead.
_TASK_USES = {"generate": "text generation (/v1/chat/completions, /v1/completions, /v1/responses)",
              "embed": "embeddings (/v1/embeddings)", "classify": "classification scores (/classify)"}
_POOLING_SAMPLING = SamplingParams(max_tokens=1, output_kind=OutputKind.FINAL_ONLY)


def utf8_size(text: str) -> int:
    """UTF-8 length of `text` without copying it when it is ASCII (`isascii` reads a flag)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def text_size(value: Any) -> int:
    """UTF-8 bytes of all the strings (keys included) in a JSON-like value: the size checks' input.
    Runs on the event loop, so it never serializes: `json.dumps` of a 5 MB conversation held the
    loop ~20 ms each time, where this costs one flag read per ASCII string. A loop, not recursion:
    a request's tool schemas may nest as deep as the JSON parser allows."""
    total, pending = 0, [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            total += utf8_size(item)
        elif isinstance(item, dict):
            total += sum(utf8_size(str(key)) for key in item)
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
        elif item is not None:
            total += len(str(item))
    return total


class InputProcessor:
    def __init__(self, info: EngineInfo, tokenizer: Tokenizer) -> None:
        self.info = info
        self.tokenizer = tokenizer
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size

    def max_prompt_bytes(self) -> int:
        """Text longer than this (UTF-8 bytes) cannot fit the context whatever it says, since no
        token stands for more than `max_token_bytes` bytes: it is refused before tokenizing."""
        return self.tokenizer.max_token_bytes * self.max_model_len

    def check_text_size(self, num_bytes: int, where: str) -> None:
        if num_bytes > self.max_prompt_bytes():
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens, but the {where} "
                f"is {num_bytes} bytes of text, more than {self.max_prompt_bytes()} bytes can hold in "
                f"{self.max_model_len} tokens. Shorten the {where}.", param=where)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not text:
            raise InvalidRequestError("prompt: is empty; give at least one token", param="prompt")
        self.check_text_size(utf8_size(text), "prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_task(self, task: str) -> None:
        """A 400 unless the model can do `task`, naming what it does instead."""
        tasks = self.info.tasks
        if task not in tasks:
            serves = " and ".join(_TASK_USES[t] for t in tasks if t in _TASK_USES)
            raise InvalidRequestError(
                f"model: this model ({self.info.architecture}) does not support {_TASK_USES[task]}; "
                f"it serves {serves}", param="model", code="unsupported_task")

    def validate_prompt(self, token_ids: list[int], where: str = "prompt", *, pooling: bool = False) -> None:
        """Raise a typed error if the prompt cannot run. A pooling prompt may fill the context."""
        if not token_ids:
            raise InvalidRequestError(f"{where}: is empty; give at least one token", param=where)
        vocab = self.vocab_size
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"{where}: token id {bad} is outside the vocabulary [0, {vocab})",
                                      param=where)
        if pooling and len(token_ids) > self.max_model_len:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens, but the {where} "
                f"has {len(token_ids)} tokens. Shorten the {where}.", param=where)
        if not pooling and len(token_ids) >= self.max_model_len:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens, but the {where} "
                f"has {len(token_ids)} tokens, leaving no room for output. Shorten the {where}.",
                param=where)

    def resolve_max_tokens(self, requested: int | None, num_prompt_tokens: int, where: str = "prompt",
                           *, strict: bool = True) -> int:
        """Output tokens to allow. Strict (the server, as OpenAI): a request for more than the
        context has room for is a 400 naming the limit and the counts. Not strict (the offline API,
        as vLLM): capped to the room."""
        room = check_output_room(self.max_model_len, num_prompt_tokens, requested if strict else None, where)
        return room if requested is None else min(requested, room)

    def make_request(self, request_id: str, token_ids: list[int], params: SamplingParams,
                     arrival_time: float, *, max_tokens: int | None = None, cache_salt: str | None = None,
                     salt_from_token: int = 0, where: str = "prompt", priority: int = 0,
                     tenant: str = "", tenant_weight: float = 1.0, lora_name: str | None = None
                     ) -> EngineCoreRequest:
        """The core's request for validated token ids. `max_tokens` defaults to the params' value
        capped to the context. `priority` (lower first) and `tenant` (fair share) steer scheduling;
        `lora_name` picks a LoRA adapter the core serves (None: the base model)."""
        self.check_task("generate")
        self.validate_prompt(token_ids, where)
        constraint = params.structured_outputs
        if constraint is not None:
            check_constraint(constraint)  # cached: the server already checked it off its event loop
            start = constraint.start_after_token_id
            if start is not None and not 0 <= start < self.vocab_size:
                raise InvalidRequestError(f"structured_outputs.start_after_token_id: {start} is outside "
                                          f"the vocabulary [0, {self.vocab_size})", param="structured_outputs")
        if max_tokens is None:
            max_tokens = self.resolve_max_tokens(params.max_tokens, len(token_ids), where, strict=False)
        return EngineCoreRequest(request_id, list(token_ids), params, max_tokens, arrival_time,
                                 cache_salt=cache_salt, salt_from_token=salt_from_token, priority=priority,
                                 tenant=tenant, tenant_weight=tenant_weight, lora_name=lora_name)

    def make_pooling_request(self, request_id: str, token_ids: list[int], pooling: PoolingParams,
                             arrival_time: float, *, where: str = "input", priority: int = 0,
                             tenant: str = "", tenant_weight: float = 1.0) -> EngineCoreRequest:
        """The core's request to embed or classify validated token ids, scheduled like `make_request`."""
        self.check_task(pooling.task)
        if pooling.dimensions is not None:
            self.check_dimensions(pooling.dimensions)
        self.validate_prompt(token_ids, where, pooling=True)
        return EngineCoreRequest(request_id, list(token_ids), _POOLING_SAMPLING, 0, arrival_time,
                                 pooling=pooling, priority=priority, tenant=tenant, tenant_weight=tenant_weight)

    def check_dimensions(self, dimensions: int) -> None:
        """Fewer dimensions only where the model was trained for it (Matryoshka): elsewhere the
        leading values of an embedding are not a usable embedding."""
        info = self.info.pooling
        size = info.hidden_size if info else 0
        if dimensions == size:
            return
        if info is None or not info.matryoshka:
            raise InvalidRequestError(
                f"dimensions: this model's embeddings have {size} dimensions and it does not support "
                "Matryoshka truncation; leave dimensions out", param="dimensions")
        allowed = info.matryoshka_dimensions
        if not 1 <= dimensions <= size or (allowed and dimensions not in allowed):
            choices = ", ".join(map(str, allowed or [size])) if allowed else f"1 to {size}"
            raise InvalidRequestError(f"dimensions: {dimensions} is not supported; this model allows "
                                      f"{choices}", param="dimensions")


def check_output_room(max_model_len: int, num_prompt_tokens: int, requested: int | None, where: str) -> int:
    """The context left for output after the prompt; raises if there is none, or (when `requested`
    is given) less than requested. Shared by the server and the tokenizer workers, which refuse an
    over-long prompt before shipping its ids back."""
    room = max_model_len - num_prompt_tokens
    if room <= 0 or (requested is not None and requested > room):
        asked = num_prompt_tokens + (requested or 0)
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {asked} tokens ({num_prompt_tokens} in the {where}, {requested or 0} in the "
            "completion). Please reduce the length of the prompt or of max_tokens.",
            param="max_tokens" if room > 0 else where)
    return room
