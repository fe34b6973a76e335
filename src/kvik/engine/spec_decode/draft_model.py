"""The draft-model proposer: a smaller model with the target's tokenizer guesses the next k tokens.

The draft model has its own weights, its own paged KV cache (as many blocks as the target's, sized
together with it) and its own `ModelRunner`, so it runs the same paged path, compiled CPU kernels
included. Per sequence it remembers how many tokens have draft KV. Each proposal first catches up on
the tokens the draft has not seen (the target's last token, and the accepted drafts' successor;
after a preemption or a pause, everything since), then runs k - 1 one-token steps, all sequences
batched in each. Draft KV past the target's confirmed tokens may hold rejected drafts and is
rolled back the way the target's is: the count moves back and the slots are overwritten.

Greedy requests take the draft's argmax (a point mass); sampled ones draw from the draft's
distribution under the request's own sampling parameters (and its generator when seeded), and keep
that distribution for the rejection step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kvik.core.errors import ConfigError
from kvik.core.tokenizer import TokenizerSpec
from kvik.engine.block_pool import BlockPool, KVBlock
from kvik.engine.cuda_graphs import GraphSettings
from kvik.engine.model_runner import ModelRunner
from kvik.engine.request import Request, RequestStatus
from kvik.engine.sampler import Sampler, argmax_rows
from kvik.engine.scheduler import ScheduledChunk
from kvik.engine.spec_decode.proposer import Draft, DraftContext
from kvik.engine.spec_decode.rejection import draw_token
from kvik.model.loader import load_model, load_model_config, resolve_model_path
from kvik.model.quant.scheme import QuantScheme, int8_activations
from kvik.model.transforms import optimize_for_inference

logger = logging.getLogger("kvik.engine")


@dataclass(slots=True, eq=False)
class DraftSequence:
    request: Request
    blocks: list[KVBlock] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens with valid draft KV


class DraftModelProposer:
    def __init__(self, model: str, *, target_tokenizer: TokenizerSpec, target_vocab_size: int,
                 device: torch.device, dtype: torch.dtype, block_size: int, max_chunk_tokens: int,
                 revision: str | None = None, tokenizer: str | None = None,
                 quantization: str | None = None, activations: str = "auto") -> None:
        path = resolve_model_path(model, revision)
        self.config = cfg = load_model_config(path)
        draft_tokenizer = TokenizerSpec.from_pretrained(tokenizer or str(path), revision)
        if _vocabulary(draft_tokenizer) != _vocabulary(target_tokenizer):
            raise ConfigError(f"speculative_model: {model} has a different tokenizer from the target "
                              "model; a draft model must share the target's vocabulary")
        loaded = load_model(path, cfg, device, dtype, show_progress=False)
        self.model = loaded.model
        # The same CPU preparation as the target's (EngineCore), in the draft's own dtype: oneDNN
        # packing and the compiled kernels, and --speculative-quantization's narrower weights (a
        # draft only has to agree with the target often, so it may be rounded more than the target).
        weights = QuantScheme(quantization) if quantization else None
        transforms = optimize_for_inference(self.model, device, dtype, weights=weights,
                                            int8_activations=int8_activations(activations, quantization))
        self.kernels = transforms.kernels
        self.weight_bytes = transforms.weight_bytes
        self.step_bytes = transforms.linear_weight_bytes  # what one draft step streams
        logger.info("draft model %s (%s, %s, %.1f MiB) for speculative decoding", path, cfg.architecture,
                    transforms.weights, self.weight_bytes / 2**20)
        self.device, self.dtype, self.block_size = device, dtype, block_size
        self.target_vocab_size = target_vocab_size
        self.max_positions = cfg.max_position_embeddings
        self.max_chunk_tokens = max_chunk_tokens
        self.kv_bytes_per_block = ModelRunner.bytes_per_block(cfg.num_layers, block_size, cfg.num_kv_heads,
                                                              cfg.head_dim, dtype)
        self.pool: BlockPool | None = None
        self.runner: ModelRunner | None = None
        self.sampler: Sampler | None = None
        self.sequences: dict[str, DraftSequence] = {}

    def start(self, num_blocks: int, sampler: Sampler, graphs: GraphSettings | None = None) -> None:
        """Allocate the draft's KV cache (the engine sized it with the target's). With the target's
        decode-graph settings, the draft's decode-only steps replay graphs too (one row per sequence,
        a few for a catch-up chunk: within the target's verification rows)."""
        cfg = self.config
        self.pool = BlockPool(num_blocks)
        self.runner = ModelRunner(self.model, num_blocks=num_blocks, block_size=self.block_size,
                                  num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                  head_dim=cfg.head_dim, device=self.device, kv_cache_dtype=self.dtype,
                                  graphs=graphs)
        self.sampler = sampler

    # -- proposing --

    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[Draft | None]:
        self._release_departed()
        drafts: dict[str, list[int]] = {}
        probs: dict[str, list[torch.Tensor]] = {}
        wanted: dict[str, int] = {}
        chunks: list[ScheduledChunk] = []
        for request, k in zip(requests, num_drafts):
            k = min(k, self.max_positions - request.num_tokens)
            sequence = self.sequences.get(request.seq_id)
            if sequence is None:
                sequence = self.sequences[request.seq_id] = DraftSequence(request)
            # Draft KV is valid only where the target confirmed the tokens.
            sequence.num_computed = min(sequence.num_computed, request.num_computed_tokens)
            if k <= 0 or not self._reserve(sequence, request.num_tokens + k - 1):
                continue
            drafts[request.seq_id], probs[request.seq_id], wanted[request.seq_id] = [], [], k
            chunks.append(self._catch_up(sequence))
        while chunks:
            result = self.runner.execute(chunks)
            self._choose(result.logits[:len(result.sample_chunks)], result.sample_chunks, drafts, probs)
            next_chunks = []
            for chunk in result.sample_chunks:
                request = chunk.request
                sequence = self.sequences[request.seq_id]
                sequence.num_computed = chunk.end
                tokens = drafts[request.seq_id]
                if len(tokens) < wanted[request.seq_id]:
                    next_chunks.append(ScheduledChunk(request, 1, chunk.end, sequence.block_ids,
                                                      list(tokens)))
            chunks = next_chunks
        out: list[Draft | None] = []
        for request in requests:
            tokens = drafts.get(request.seq_id)
            if not tokens:
                out.append(None)
                continue
            rows = probs[request.seq_id]
            out.append(Draft(tokens, torch.stack(rows) if rows else None))
        return out

    def _catch_up(self, sequence: DraftSequence) -> ScheduledChunk:
        """The chunk of known tokens the draft has not computed, ending at the last one; a backlog
        longer than one chunk is computed first, in pieces."""
        request = sequence.request
        while request.num_tokens - sequence.num_computed > self.max_chunk_tokens:
            piece = ScheduledChunk(request, self.max_chunk_tokens, sequence.num_computed, sequence.block_ids)
            self.runner.execute([piece])
            sequence.num_computed = piece.end
        return ScheduledChunk(request, request.num_tokens - sequence.num_computed, sequence.num_computed,
                              sequence.block_ids)

    def _choose(self, logits: torch.Tensor, chunks: list[ScheduledChunk], drafts: dict[str, list[int]],
                probs: dict[str, list[torch.Tensor]]) -> None:
        """Append the next draft token of each chunk's sequence (row i for chunks[i])."""
        vocab = self.target_vocab_size
        if logits.shape[-1] > vocab:
            logits = logits[:, :vocab]
        elif logits.shape[-1] < vocab:
            logits = torch.nn.functional.pad(logits, (0, vocab - logits.shape[-1]), value=float("-inf"))
        contexts = [DraftContext(c.request, list(drafts[c.request.seq_id])) for c in chunks]
        processed = self.sampler.processed(logits, contexts)
        sampled = [i for i, c in enumerate(chunks) if not c.request.params.greedy]
        distributions = (self.sampler.distribution(processed[sampled], [contexts[i] for i in sampled])
                         if sampled else None)
        greedy_tokens = argmax_rows(processed).tolist()
        for i, chunk in enumerate(chunks):
            request = chunk.request
            if request.params.greedy:
                drafts[request.seq_id].append(greedy_tokens[i])
                continue
            row = distributions[sampled.index(i)]
            drafts[request.seq_id].append(draw_token(row, self.sampler.generator_for(request)))
            probs[request.seq_id].append(row)

    # -- draft KV blocks --

    def _reserve(self, sequence: DraftSequence, num_tokens: int) -> bool:
        needed = -(-num_tokens // self.block_size) - len(sequence.blocks)
        if needed <= 0:
            return True
        if needed > self.pool.num_free_blocks:
            return False  # no drafts this step; the target runs on
        blocks = self.pool.allocate(needed)
        sequence.blocks.extend(blocks)
        sequence.block_ids.extend(b.block_id for b in blocks)
        return True

    def _release_departed(self) -> None:
        """Free the draft KV of sequences that finished or were preempted."""
        for seq_id, sequence in list(self.sequences.items()):
            if sequence.request.status is not RequestStatus.RUNNING:
                self.pool.release(sequence.blocks)
                del self.sequences[seq_id]

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks if self.pool else 0


def _vocabulary(spec: TokenizerSpec) -> dict[str, int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(spec.backend_json).get_vocab(with_added_tokens=True)
