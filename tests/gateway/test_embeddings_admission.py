"""What the gateway reads from an embeddings body: its texts (for redaction and moderation) and
what it may cost (for budgets and TPM), without a tokenizer."""

from __future__ import annotations

import pytest

from kvik.gateway.guardrails.text import replace_request_texts, request_texts
from kvik.gateway.tokens import estimate_tokens


@pytest.mark.parametrize("inputs,texts,prompt", [
    ("one text", ["one text"], 8),
    (["a b", "céé"], ["a b", "céé"], 3 + 5),  # UTF-8 bytes bound a byte-level BPE's tokens
    ([5, 6, 7], [], 3),  # token ids count exactly
    ([[5, 6], [7]], [], 3),
])
def test_embedding_inputs_are_texts_and_reserve_no_completion(inputs, texts, prompt) -> None:
    body = {"model": "m", "input": inputs}
    assert request_texts(body) == texts
    estimate = estimate_tokens(body, texts, reserve_completion_tokens=256, generates=False)
    assert (estimate.prompt, estimate.completion, estimate.explicit) == (prompt, 0, False)


def test_redaction_rewrites_embedding_inputs_in_place() -> None:
    body = {"model": "m", "input": ["keep", "mail me"], "user": "u"}
    assert replace_request_texts(body, ["keep", "[EMAIL]"]) == {"model": "m", "input": ["keep", "[EMAIL]"], "user": "u"}
    assert body["input"] == ["keep", "mail me"]  # a copy


def test_generating_endpoints_still_reserve_their_completion() -> None:
    body = {"model": "m", "prompt": "hi"}
    assert estimate_tokens(body, ["hi"], reserve_completion_tokens=256).completion == 256
