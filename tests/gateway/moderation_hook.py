"""The moderation hook the gateway tests configure (`moderation_hook:block_forbidden`)."""

from __future__ import annotations

from kvik.gateway.guardrails.moderation import ModerationRequest

BLOCKED_WORD = "forbidden-topic"


def block_forbidden(request: ModerationRequest) -> str | None:
    """Block any request that mentions the blocked word; let everything else through."""
    if any(BLOCKED_WORD in text for text in request.texts):
        return f"Requests about {BLOCKED_WORD} are not allowed on this gateway."
    return None
