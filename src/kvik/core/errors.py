"""Typed errors. Each carries what the user needs to fix the problem and maps to one HTTP status.

The server and the gateway turn any `KvikError` into the OpenAI error envelope
`{"error": {"message", "type", "param", "code"}}` with `http_status`, in one place
(`kvik.protocol.errors`).
"""

from __future__ import annotations


class KvikError(Exception):
    """Base class. `error_type` and `code` follow the OpenAI error vocabulary."""

    http_status: int = 500
    error_type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def __reduce__(self) -> tuple:
        # Errors cross process boundaries (tokenization workers); keep param, code and the rest.
        return _restore_error, (type(self), self.message, dict(self.__dict__))


def _restore_error(cls: type[KvikError], message: str, state: dict) -> KvikError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class InvalidRequestError(KvikError):
    """The request is malformed or asks for something impossible (HTTP 400)."""

    http_status = 400
    error_type = "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    """Prompt plus requested output does not fit the model's context window."""

    code = "context_length_exceeded"


class ContentFilterError(InvalidRequestError):
    """A guardrail blocked the request."""

    code = "content_filter"


class AuthenticationError(KvikError):
    """Missing or wrong API key (HTTP 401)."""

    http_status = 401
    error_type = "invalid_request_error"  # what OpenAI sends with code invalid_api_key
    code = "invalid_api_key"


class PermissionDeniedError(KvikError):
    """The key is valid but may not use this resource (HTTP 403)."""

    http_status = 403
    error_type = "permission_error"
    code = "permission_denied"


class NotFoundError(KvikError):
    """HTTP 404."""

    http_status = 404
    error_type = "invalid_request_error"
    code = "not_found"


class ModelNotFoundError(NotFoundError):
    code = "model_not_found"


class RequestTooLargeError(KvikError):
    """The HTTP body exceeds the configured limit (HTTP 413)."""

    http_status = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class RetryableError(KvikError):
    """Errors the client should retry later; carries `retry_after` seconds for the Retry-After header."""

    def __init__(self, message: str, *, retry_after: float = 1.0, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message, param=param, code=code)
        self.retry_after = retry_after


class RateLimitError(RetryableError):
    """Too many requests or tokens for this key, or the waiting queue is full (HTTP 429)."""

    http_status = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"


class ServiceUnavailableError(RetryableError):
    """The service is loading, draining or overloaded (HTTP 503)."""

    http_status = 503
    error_type = "service_unavailable"
    code = "service_unavailable"


class UpstreamError(KvikError):
    """An upstream replica failed and no retry succeeded (HTTP 502)."""

    http_status = 502
    error_type = "server_error"
    code = "upstream_error"


# Errors raised while loading a model or starting the engine. They never reach HTTP clients as
# such: the process refuses to start and prints the message.


class ConfigError(KvikError):
    """A configuration value is invalid; the message names the field."""

    error_type = "config_error"


class UnsupportedArchitectureError(ConfigError):
    """config.json names an architecture kvik does not implement."""


class MissingWeightsError(ConfigError):
    """The checkpoint lacks tensors the model needs, or has none at all."""


class InsufficientMemoryError(ConfigError):
    """The model plus the smallest usable KV cache does not fit in the memory budget."""


# Added for the gateway.


class QuotaExceededError(KvikError):
    """The key has used up its token budget (HTTP 429, OpenAI's `insufficient_quota`). Not a
    `RetryableError`: waiting does not help, so no Retry-After is sent."""

    http_status = 429
    error_type = "insufficient_quota"
    code = "insufficient_quota"


# Added for multi-LoRA serving.


class ConflictError(KvikError):
    """The request conflicts with the current state (HTTP 409): e.g. unloading an adapter that
    running requests use, or loading one under a name already taken."""

    http_status = 409
    error_type = "invalid_request_error"
    code = "conflict"


class LoRAAdapterError(InvalidRequestError):
    """A LoRA adapter cannot be served: not PEFT LoRA, rank above --max-lora-rank, or a base model
    it was not trained for (HTTP 400)."""

    code = "invalid_lora_adapter"
