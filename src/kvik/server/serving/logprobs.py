"""Logprobs in the two shapes OpenAI uses: chat's `content` list and completions' parallel lists."""

from __future__ import annotations

from typing import Any

from kvik.core.outputs import Logprob
from kvik.core.tokenizer import Tokenizer


def top_alternatives(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens of a logprob entry, most likely first."""
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank <= k), key=lambda x: x[1].rank)[:k]


def chat_logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], k: int) -> dict[str, Any]:
    content = []
    for token, entry in zip(token_ids, entries):
        chosen = entry[token]
        text = chosen.decoded_token or ""
        content.append({
            "token": text, "logprob": chosen.logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": lp.decoded_token or "", "logprob": lp.logprob,
                              "bytes": list((lp.decoded_token or "").encode())}
                             for _, lp in top_alternatives(entry, k)],
        })
    return {"content": content}


def completion_logprobs(tokenizer: Tokenizer, k: int, token_ids: list[int],
                        entries: list[dict[int, Logprob] | None], offset: int) -> dict[str, Any]:
    """The legacy shape: parallel lists tokens / token_logprobs / top_logprobs / text_offset."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries):
        text = tokenizer.token_text(token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:  # the first prompt token: nothing precedes it
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(entry[token].logprob)
        tops.append({lp.decoded_token or "": lp.logprob for _, lp in top_alternatives(entry, k)})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}
