"""Chat templates rendered in a sandbox with limits.

A chat template is Jinja code. The model's own template is the operator's code; a template sent in a
request is a stranger's, and kvik refuses those unless the operator opts in. Either way the template
renders in Jinja's immutable sandbox (no attribute access to Python internals, no mutation of the
data passed in) with the environment transformers gives chat templates (trim_blocks, lstrip_blocks,
loop controls, `tojson`, `raise_exception`, `strftime_now`, `namespace`, the `{% generation %}`
tag), plus limits Jinja does not have: string and list repetition, concatenation and powers that
would build huge values fail at once, and the rendered text stops at `max_output_chars`. A template
can still loop for a long time without producing output; the server renders requests that could do
that in worker processes it kills on a deadline (`kvik.engine.preprocess_pool`).
"""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

from kvik.core.errors import InvalidRequestError

# Variables the renderer owns; a request's chat_template_kwargs may not set them.
RESERVED_TEMPLATE_ARGUMENTS = frozenset({
    "messages", "add_generation_prompt", "tools", "documents", "chat_template", "continue_final_message",
    "tokenize", "return_dict", "raise_exception", "strftime_now", "namespace", "dict", "range", "lipsum",
    "cycler", "joiner", "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
    "mask_token",
})


@dataclass(slots=True)
class TemplateLimits:
    max_output_chars: int = 64 * 2**20  # the rendered prompt
    max_value_size: int = 2**20  # characters or items one `*`, `+` or `**` may produce


class ChatTemplateError(InvalidRequestError):
    """The chat template failed or exceeded a limit while rendering this request's messages."""


def _environment(limits: TemplateLimits) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
        transformers; for serving it renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        @staticmethod
        def _body(caller: Any) -> str:
            return caller()

    def too_big(what: str) -> ChatTemplateError:
        return ChatTemplateError(f"chat template: {what} exceeds the limit of {limits.max_value_size} "
                                 "characters or items", param="messages")

    def size(value: Any) -> int:
        return len(value) if isinstance(value, (str, list, tuple)) else 0

    class LimitedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+"})

        def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
            if op == "*":
                count = right if isinstance(right, int) else left if isinstance(left, int) else 1
                if max(size(left), size(right)) * max(count, 0) > limits.max_value_size:
                    raise too_big("a repetition")
                return operator.mul(left, right)
            if op == "+":
                if size(left) + size(right) > limits.max_value_size:
                    raise too_big("a concatenation")
                return operator.add(left, right)
            if isinstance(left, (int, float)) and isinstance(right, (int, float)) and \
                    abs(right) * max(abs(left), 2).bit_length() > 8 * limits.max_value_size:
                raise too_big("a power")
            return operator.pow(left, right)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML; chat templates expect plain JSON, as transformers gives.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class Namespace(jinja2.utils.Namespace):
        """Jinja's namespace, refusing underscore names (no path to Python internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")

    env = LimitedSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, namespace=Namespace,
                       dict=lambda *args, **kwargs: dict(*args, **kwargs))
    return env


@lru_cache(maxsize=32)
def _compile(source: str, max_output_chars: int, max_value_size: int) -> Any:
    return _environment(TemplateLimits(max_output_chars, max_value_size)).from_string(source)


def plain_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as templates expect them (transformers' normalisation): keys whose value is None are
    dropped, and a message's reasoning is also offered as `reasoning_content` and `thinking`."""
    out = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning")
                          if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class ChatTemplateRenderer:
    def __init__(self, default: str | dict[str, str] | None, special_tokens: dict[str, str],
                 limits: TemplateLimits | None = None) -> None:
        self.default = default
        self.special_tokens = dict(special_tokens)
        self.limits = limits or TemplateLimits()

    def template_source(self, template: str | None, tools: Any) -> str:
        """The template to use: the request's (already authorised by the caller), one of the model's
        named templates, or the model's default (its `tool_use` one when tools are given)."""
        named = self.default if isinstance(self.default, dict) else {}
        if template is not None:
            return named.get(template, template)
        if isinstance(self.default, str) and self.default:
            return self.default
        if named:
            if tools and "tool_use" in named:
                return named["tool_use"]
            if "default" in named:
                return named["default"]
        raise InvalidRequestError("this model's tokenizer has no chat template; use the completions API "
                                  "or ask the operator to configure one", param="messages")

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               template: str | None = None, tools: list[dict[str, Any]] | None = None,
               documents: list[dict[str, Any]] | None = None,
               template_kwargs: dict[str, Any] | None = None) -> str:
        import jinja2

        source = self.template_source(template, tools)
        limits = self.limits
        try:
            compiled = _compile(source, limits.max_output_chars, limits.max_value_size)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template: syntax error on line {exc.lineno}: {exc.message}",
                                    param="chat_template") from exc
        variables = {**self.special_tokens, **(template_kwargs or {}),
                     "messages": plain_messages(messages), "tools": tools, "documents": documents,
                     "add_generation_prompt": add_generation_prompt}
        pieces: list[str] = []
        length = 0
        try:
            for piece in compiled.generate(**variables):
                length += len(piece)
                if length > limits.max_output_chars:
                    raise ChatTemplateError(
                        f"chat template: the rendered prompt exceeds {limits.max_output_chars} characters",
                        param="messages")
                pieces.append(piece)
        except ChatTemplateError:
            raise
        except MemoryError as exc:
            raise ChatTemplateError("chat template: ran out of memory while rendering",
                                    param="messages") from exc
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError,
                ZeroDivisionError, OverflowError, RecursionError) as exc:
            # Template errors come from the request's messages (bad roles, missing fields) or, for a
            # request's own template, from the template.
            raise ChatTemplateError(f"messages: the chat template rejected them ({exc})",
                                    param="messages") from exc
        return "".join(pieces)


def check_template_kwargs(kwargs: dict[str, Any] | None, max_bytes: int = 64 * 1024) -> dict[str, Any]:
    """A request's chat_template_kwargs: JSON values under names the renderer does not own."""
    if not kwargs:
        return {}
    for name in kwargs:
        if name in RESERVED_TEMPLATE_ARGUMENTS or name.startswith("_"):
            raise InvalidRequestError(
                f"chat_template_kwargs: {name!r} is set by the server and may not be overridden",
                param="chat_template_kwargs")
    try:
        encoded = json.dumps(kwargs)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"chat_template_kwargs: values must be JSON ({exc})",
                                  param="chat_template_kwargs") from exc
    if len(encoded) > max_bytes:
        raise InvalidRequestError(f"chat_template_kwargs: {len(encoded)} bytes; the limit is {max_bytes}",
                                  param="chat_template_kwargs")
    return dict(kwargs)
