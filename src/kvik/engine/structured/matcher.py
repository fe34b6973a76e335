"""Grammar matchers in the engine core: one per constrained sequence, a token bitmask per step.

`GrammarBackend` owns llguidance's view of the tokenizer (built once, in a background thread, since
a 150k-token vocabulary takes about a second) and a cache of compiled grammars keyed by grammar
text: a new sequence gets a copy of the cached matcher, so `n > 1` siblings and repeated schemas
compile once. Each step, `apply_masks` fills one bitmask row per constrained sequence (llguidance
computes allowed tokens from the grammar state; ~0.1 ms a row) and sets every other logit to -inf;
`GrammarState.accept` advances a matcher by the token the sampler chose.

A sequence's matcher follows its generated tokens and nothing else, so preemption (which keeps the
tokens and recomputes only KV) and prefix-cache hits (which skip prompt compute) leave it valid.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from kvik.core.errors import InvalidRequestError
from kvik.core.sampling_params import StructuredOutputs
from kvik.engine.structured.grammar import check_constraint

logger = logging.getLogger("kvik.engine")

COMPILED_CACHE_SIZE = 256  # distinct grammars kept compiled (each a few KB to a few MB)


class GrammarState:
    """One sequence's position in its grammar. Inactive (no mask) until `start_after_token_id` was
    generated, e.g. while a reasoning model thinks."""

    __slots__ = ("matcher", "waiting_for")

    def __init__(self, matcher: Any, start_after_token_id: int | None) -> None:
        self.matcher = matcher
        self.waiting_for = start_after_token_id

    @property
    def active(self) -> bool:
        return self.waiting_for is None

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False if the grammar rejects it (the matcher then stays
        in an error state)."""
        if self.waiting_for is not None:
            if token_id == self.waiting_for:
                self.waiting_for = None
            return True
        return self.matcher.consume_token(token_id)

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class GrammarBackend:
    def __init__(self, tokenizer_json: str, model_vocab_size: int, tokenizer_vocab_size: int,
                 eos_token_ids: list[int]) -> None:
        # Bitmask width covers every logit column; ids past the tokenizer's (Qwen pads its
        # embedding matrix) have no text and are never allowed.
        self.vocab_size = max(model_vocab_size, tokenizer_vocab_size)
        self.num_words = (self.vocab_size + 31) // 32
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: Any = None
        self._tokenizer_error: BaseException | None = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._bitmask = np.zeros((0, self.num_words), dtype=np.int32)  # reused across steps
        self._ready = threading.Thread(target=self._build_tokenizer, args=(tokenizer_json,),
                                       name="kvik-grammar-tokenizer", daemon=True)
        self._ready.start()

    def _build_tokenizer(self, tokenizer_json: str) -> None:
        try:
            import llguidance

            self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=self.vocab_size,
                                                     eos_token=self.eos_token_ids)
        except BaseException as exc:  # noqa: BLE001 - reported when a request needs it
            self._tokenizer_error = exc

    @property
    def tokenizer(self) -> Any:
        self._ready.join()
        if self._tokenizer is None:
            raise InvalidRequestError(f"structured outputs are unavailable for this model's tokenizer "
                                      f"({self._tokenizer_error})", param="structured_outputs")
        return self._tokenizer

    def new_state(self, constraint: StructuredOutputs) -> GrammarState:
        """A fresh matcher for one sequence; raises InvalidRequestError if the grammar fails."""
        import llguidance

        grammar = check_constraint(constraint)
        prototype = self._compiled.get(grammar)
        if prototype is None:
            prototype = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if prototype.is_error():
                raise InvalidRequestError(f"structured_outputs: {prototype.get_error()}",
                                          param="structured_outputs")
            self._compiled[grammar] = prototype
            if len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return GrammarState(prototype.deep_copy(), constraint.start_after_token_id)

    def apply_masks(self, logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
        """Set to -inf, in place, every logit of `logits[rows[i]]` that `states[i]` does not allow.
        logits: (R, V) float; rows ascending."""
        count, vocab = len(rows), logits.shape[-1]
        if self._bitmask.shape[0] < count:
            self._bitmask = np.zeros((count, self.num_words), dtype=np.int32)
        bitmask = self._bitmask[:count]
        row_bytes = self.num_words * 4
        for i, state in enumerate(states):
            state.matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data + i * row_bytes, row_bytes)
        # Bit b of word w allows token 32 * w + b (little-endian words and bit order); unpacking the
        # inverted words gives one byte per token that is 1 where the token is blocked.
        blocked = np.unpackbits((~bitmask).view(np.uint8), axis=1, count=vocab, bitorder="little")
        blocked_rows = torch.from_numpy(blocked.view(np.bool_)).to(logits.device)
        if count == logits.shape[0]:  # every row constrained: no gather, no scatter
            logits.masked_fill_(blocked_rows, float("-inf"))
            return
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill_(blocked_rows, float("-inf"))
