"""Parsing a client's request body: JSON, then the few fields the gateway itself reads.

The gateway is a proxy: the replica validates the request in full. What is checked here is what the
gateway relies on (the model, streaming, the token counts it reserves, the shape it walks for
guardrails) and what would hurt the gateway itself (nesting deep enough to exhaust the recursion
limit of any later walk). Each failure is a 400 that names the field and says what to send.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvik.core import client_json
from kvik.core.errors import InvalidRequestError
from kvik.protocol.openai import MAX_N

MAX_JSON_DEPTH = 64  # objects and arrays inside one another; tool schemas need a dozen or so
MAX_MODEL_NAME_CHARS = 256
MAX_TOKENS_LIMIT = 2**31 - 1


@dataclass(slots=True, frozen=True)
class Endpoint:
    name: str  # "chat.completions", "completions", "embeddings", "classify", "responses": usage rows, moderation
    path: str  # the upstream path
    required_field: str  # "messages", "prompt" or "input"
    # Whether the answer is generated: completion tokens to reserve, sampling that decides whether a
    # cached answer may stand in. Embeddings and classification are neither: one deterministic
    # vector or set of scores per input.
    generates: bool = True
    # The Responses API: typed stream events ending in `response.completed` (not chat chunks ending in
    # `[DONE]`), never answered from the cache (a stored response is state on one replica), and
    # continued (`previous_response_id`) on the replica that stored it.
    responses: bool = False


CHAT = Endpoint("chat.completions", "/v1/chat/completions", "messages")
COMPLETIONS = Endpoint("completions", "/v1/completions", "prompt")
EMBEDDINGS = Endpoint("embeddings", "/v1/embeddings", "input", generates=False)
# vLLM's /classify (a sequence-classification or reward model's scores): the inputs of embeddings.
CLASSIFY = Endpoint("classify", "/classify", "input", generates=False)
RESPONSES = Endpoint("responses", "/v1/responses", "input", responses=True)
MAX_RESPONSE_ID_CHARS = 128


def parse_body(raw: bytes, endpoint: Endpoint) -> dict[str, Any]:
    """The request as a dict, or `InvalidRequestError`. CPU-bound for large bodies: the caller runs
    it off the event loop."""
    try:
        body = client_json.loads(raw)
    except RecursionError:
        raise InvalidRequestError(f"The request body nests objects or arrays deeper than {MAX_JSON_DEPTH} "
                                  f"levels.") from None
    except ValueError as exc:  # json.JSONDecodeError and UnicodeDecodeError
        raise InvalidRequestError(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    _check_depth(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequestError("you must provide a model parameter", param="model")
    if len(model) > MAX_MODEL_NAME_CHARS:
        raise InvalidRequestError(f"'model' is longer than {MAX_MODEL_NAME_CHARS} characters.", param="model")
    if endpoint.required_field not in body:
        raise InvalidRequestError(f"Missing required parameter: '{endpoint.required_field}'.",
                                  param=endpoint.required_field)
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise InvalidRequestError("'stream' must be a boolean.", param="stream")
    if body.get("stream") and not endpoint.generates:
        raise InvalidRequestError(f"'stream': {endpoint.name} are not streamed; leave it out.", param="stream")
    _check_stream_options(body.get("stream_options"))
    for name in ("max_tokens", "max_completion_tokens"):
        _check_int(body, name, 0, MAX_TOKENS_LIMIT)
    if endpoint.responses:
        _check_int(body, "max_output_tokens", 1, MAX_TOKENS_LIMIT)
        previous = body.get("previous_response_id")
        if previous is not None and not (isinstance(previous, str) and 0 < len(previous) <= MAX_RESPONSE_ID_CHARS):
            raise InvalidRequestError(f"'previous_response_id' must be the id of a stored response (a string of "
                                      f"1 to {MAX_RESPONSE_ID_CHARS} characters), or null.",
                                      param="previous_response_id")
        if body.get("store") is not None and not isinstance(body["store"], bool):
            raise InvalidRequestError("'store' must be a boolean.", param="store")
    for name in ("n", "best_of"):
        _check_int(body, name, 1, MAX_N)
    return body


def wants_usage_chunk(body: dict[str, Any]) -> bool:
    """Did the client ask for the streamed usage chunk (`stream_options.include_usage`)?"""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _check_stream_options(options: Any) -> None:
    if options is None:
        return
    if not isinstance(options, dict):
        raise InvalidRequestError("'stream_options' must be an object such as {\"include_usage\": true}, or null.",
                                  param="stream_options")
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise InvalidRequestError("'stream_options.include_usage' must be a boolean.",
                                  param="stream_options.include_usage")


def _check_int(body: dict[str, Any], name: str, low: int, high: int) -> None:
    value = body.get(name)
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidRequestError(f"'{name}' must be an integer from {low} to {high}, or null; got {value!r:.40}.",
                                  param=name)


def _check_depth(body: dict[str, Any]) -> None:
    """Iterative, so a hostile nesting cannot exhaust the stack here; later recursive walks (JSON
    encoding, guardrails) then stay far from the recursion limit."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            if isinstance(child, (dict, list)):
                if depth >= MAX_JSON_DEPTH:
                    raise InvalidRequestError(f"The request body nests objects or arrays deeper than "
                                              f"{MAX_JSON_DEPTH} levels.")
                stack.append((child, depth + 1))
