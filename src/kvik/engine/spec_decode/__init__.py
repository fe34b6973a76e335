"""Speculative decoding: propose draft tokens cheaply, verify them in one forward of the target.

After every step, a proposer guesses up to k next tokens for each decoding sequence: the n-gram
proposer (`ngram.py`) looks the sequence's last few tokens up earlier in its own context and copies
what followed; the draft-model proposer (`draft_model.py`) runs a small model with the same
tokenizer. The scheduler schedules the drafts after the known tokens inside its token budget, the
model runner computes the last known token and every draft as decode rows of one forward through the
normal paged path, and `rejection.py` keeps the longest prefix the target agrees with plus one token
of its own (greedy: exact match; sampled: speculative sampling, so outputs follow the target's
distribution exactly). Rejected drafts' KV is rolled back by the scheduler (`num_computed_tokens`
moves back; blocks stay in the sequence's table and are reused). `adaptive.py` sizes k per sequence
from its recent acceptance and turns speculation off while it does not pay.

`SpecDecoder` (`decoder.py`) is what the engine core calls: `propose(running)` after a step,
`verify(logits, slices)` inside one.
"""

from kvik.engine.spec_decode.decoder import SpecDecoder, SpecDecodeStats, build_spec_decoder
from kvik.engine.spec_decode.proposer import Draft, DraftContext, Proposer

__all__ = ["Draft", "DraftContext", "Proposer", "SpecDecodeStats", "SpecDecoder", "build_spec_decoder"]
