"""The pluggable moderation hook.

The config names a callable, `guardrails.moderation.hook: "package.module:function"`, that receives a
`ModerationRequest` and returns None (or True) to let the request through, or a reason string (or
False) to block it; it may also raise `ContentFilterError` itself.
It may be a plain or an `async` function; a plain one runs in a worker thread, so it may call a
remote moderation API without stalling the gateway. A blocked request gets HTTP 400 with the
OpenAI error code `content_filter`. The hook sees the text after PII redaction.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvik.core.errors import ContentFilterError
from kvik.gateway.config import ModerationConfig

logger = logging.getLogger("kvik.gateway.moderation")


@dataclass(slots=True, frozen=True)
class ModerationRequest:
    model: str  # the gateway's model name
    endpoint: str  # "chat.completions" or "completions"
    texts: list[str]  # message contents / prompts, PII already redacted
    key_id: str | None  # None when auth is disabled


class ModerationHook:
    def __init__(self, config: ModerationConfig) -> None:
        self._config = config
        module_name, _, function_name = (config.hook or "").partition(":")
        self._hook: Callable[[ModerationRequest], Any] = getattr(importlib.import_module(module_name),
                                                                 function_name)
        self._is_async = inspect.iscoroutinefunction(self._hook)

    async def check(self, request: ModerationRequest) -> None:
        """Raise `ContentFilterError` when the hook blocks the request."""
        try:
            if self._is_async:
                verdict = await asyncio.wait_for(self._hook(request), self._config.timeout_s)
            else:
                verdict = await asyncio.wait_for(asyncio.to_thread(self._hook, request), self._config.timeout_s)
        except ContentFilterError:
            raise
        except Exception as exc:
            logger.warning("moderation hook %s failed: %r", self._config.hook, exc)
            if self._config.fail_open:
                return
            raise ContentFilterError("The request could not be checked by the content filter.") from None
        if verdict is not None and verdict is not True:
            reason = verdict if isinstance(verdict, str) else "The request was blocked by the content filter."
            raise ContentFilterError(reason)
