"""Prompt lookup: propose what followed the last occurrence of the sequence's last n tokens.

When a model rewrites a passage, edits code or quotes a document, its next tokens are very often
the ones that followed the same few tokens earlier in its context. The proposer finds the most
recent earlier occurrence of the last n tokens (n from max_n down to min_n, longest first) and
proposes the k tokens that followed it; past the end of the known tokens it keeps copying with the
same period, which proposes the continuation of a repeating stretch. No second model, no KV.

Each sequence keeps a hash index of its n-grams (n-gram -> where its latest occurrence ends),
extended by the tokens appended since the last proposal, so a lookup costs O(max_n) whatever the
context length.
"""

from __future__ import annotations

from kvik.core.errors import ConfigError
from kvik.engine.request import Request
from kvik.engine.spec_decode.proposer import Draft


class NgramIndex:
    """n-gram -> end position of its latest occurrence, for every n in [min_n, max_n]."""

    __slots__ = ("tables", "num_indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(max_n, min_n - 1, -1)}
        self.num_indexed = 0  # n-grams ending at positions < num_indexed are in the tables

    def extend(self, tokens: list[int], upto: int) -> None:
        """Index the n-grams ending at positions [num_indexed, upto)."""
        for end in range(self.num_indexed, upto):
            for n, table in self.tables.items():
                if end + 1 >= n:
                    table[tuple(tokens[end + 1 - n:end + 1])] = end
        self.num_indexed = max(self.num_indexed, upto)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens after the latest earlier occurrence of the longest matching suffix."""
        length = len(tokens)
        self.extend(tokens, length - 1)  # every n-gram except the suffix itself
        for n, table in self.tables.items():
            if length < n:
                continue
            end = table.get(tuple(tokens[length - n:]))
            if end is None:
                continue
            draft: list[int] = []
            for position in range(end + 1, end + 1 + k):
                draft.append(tokens[position] if position < length else draft[position - length])
            return draft
        return []


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"prompt_lookup_min/max: need 1 <= min <= max, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[Draft | None]:
        drafts: list[Draft | None] = []
        for request, k in zip(requests, num_drafts):
            state = request.spec_state
            if state.proposer_state is None:
                state.proposer_state = NgramIndex(self.min_n, self.max_n)
            tokens = state.proposer_state.lookup(request.all_token_ids, k)
            drafts.append(Draft(tokens) if tokens else None)
        return drafts
