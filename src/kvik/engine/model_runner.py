"""Turn a scheduled step into one batched forward over a flat token batch.

The batch holds every scheduled token of every sequence: decode rows first (attended together),
then prefill chunks. A decode row is one query token attending to the cache up to its own position:
a one-token decode, or one row of a chunk that verifies draft tokens (speculative decoding: the last
known token and each draft after it), so verifying k drafts computes exactly what k + 1 single
decodes would, on the same path (the compiled decode stack for up to 4 rows). Logits are computed
only for rows that need them: the last token of each sequence whose known tokens are now all
computed (to sample from), every row of a verified chunk, and prompt positions of sequences that
asked for prompt logprobs. A pooling request whose prompt is now computed gets its
pooled vector instead (`kvik.model.pooling`): truncated and normalised for embeddings, through the
model's score head for classification. An encoder model has no KV cache (`num_blocks=0`): every
chunk is a whole prompt attended on its own, and no slot mapping is needed.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch
from torch import nn

from kvik.engine.cuda_graphs import DecodeGraphs, GraphSettings
from kvik.engine.scheduler import ScheduledChunk
from kvik.model.huge_pages import advise_huge_pages
from kvik.model.layers.attention import AttentionMetadata, PrefillSpan
from kvik.model.layers.kv_cache import PagedKVCache, kv_bytes_per_token
from kvik.model.lora import LoRAModel
from kvik.model.pooling import PoolingConfig, PoolSpan, finish_embeddings, pool
from kvik.model.transforms import bind_kv_cache
from kvik.model.transforms.decode_stack import DecodeStackModel, GreedyHead, greedy_head
from kvik.model.transforms.screened_head import drop_screen


@dataclass(slots=True)
class PromptLogitsSlice:
    """Logits rows scoring prompt tokens [first_token, first_token + rows) of one sequence."""

    chunk: ScheduledChunk
    first_token: int
    row_start: int
    num_rows: int


@dataclass(slots=True)
class VerifySlice:
    """Logits rows [row_start, row_start + num_rows) of a chunk with draft tokens: row j scores the
    token after the last known one plus j drafts (num_rows = drafts + 1)."""

    chunk: ScheduledChunk
    row_start: int
    num_rows: int


@dataclass(slots=True)
class RunnerOutput:
    # (rows, vocab) float32: sampling rows first, then verification rows, then prompt-logprob rows
    logits: torch.Tensor
    sample_chunks: list[ScheduledChunk] = field(default_factory=list)  # row i samples for chunk i
    prompt_slices: list[PromptLogitsSlice] = field(default_factory=list)
    verify_slices: list[VerifySlice] = field(default_factory=list)
    # Pooling requests finished this step: (chunk, 1-D float32 CPU tensor).
    pooled: list[tuple[ScheduledChunk, torch.Tensor]] = field(default_factory=list)


# A continuing chunk of at most this many tokens runs as decode rows (ModelRunner._as_decode_rows);
# a verification of the default 3 drafts is 4 rows.
SMALL_CHUNK_DECODE_ROWS = 4


class ModelRunner:
    def __init__(self, model: nn.Module, *, num_blocks: int, block_size: int, num_layers: int,
                 num_kv_heads: int, head_dim: int, device: torch.device, kv_cache_dtype: torch.dtype,
                 pooling: PoolingConfig | None = None, lora: LoRAModel | None = None,
                 graphs: GraphSettings | None = None) -> None:
        self.model = model
        self.lora = lora  # LoRA slots' view of the model (multi-LoRA serving), or None
        self.block_size = block_size
        self.device = device
        self.on_cpu = torch.device(device).type == "cpu"
        self.pooling = pooling
        self.has_kv_cache = num_blocks > 0
        self.graphs: DecodeGraphs | None = None
        self._greedy_head: tuple[object, GreedyHead | None] | None = None  # (decode stack, its LM head's kernels)
        if not self.has_kv_cache:  # an encoder
            self.kv_cache = None
            self.cache_binding = None
            return
        # Decode graphs pad a step's rows with rows that write to one spare block past the pool's
        # (kvik.engine.cuda_graphs); LoRA steps change per request, so they always run eagerly.
        use_graphs = graphs is not None and lora is None
        # One allocation for every layer: (layers, k/v, kv_heads, blocks, block_size, head_dim), plus
        # per-token scales for int8. Zeroed so that padding slots read by the batched gather are
        # finite (masked afterwards); huge pages requested before the zeroing touches the memory.
        self.kv_cache = PagedKVCache.empty(num_layers, num_kv_heads, num_blocks + int(use_graphs),
                                           self.block_size, head_dim, kv_cache_dtype, device)
        advise_huge_pages(self.kv_cache.data)
        self.kv_cache.zero_()
        self.cache_binding = bind_kv_cache(model, self.kv_cache)
        if use_graphs:
            self.graphs = DecodeGraphs(model, graphs, block_size=block_size, pad_slot=num_blocks * block_size,
                                       device=device)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return block_size * kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)

    def execute(self, chunks: list[ScheduledChunk]) -> RunnerOutput:
        return _in_inference_mode(self._execute, chunks)

    def _execute(self, chunks: list[ScheduledChunk]) -> RunnerOutput:
        plain = self._plain_decode(chunks)
        if plain is not None:
            return plain
        decodes = [c for c in chunks if self._as_decode_rows(c)]
        prefills = [c for c in chunks if not self._as_decode_rows(c)]
        if self.lora is not None:
            # Each adapter's tokens in one run of decodes and one of prefills: the LoRA layers add
            # them segment by segment (the order of chunks matters to nothing else).
            decodes.sort(key=lambda c: c.request.lora_slot)
            prefills.sort(key=lambda c: c.request.lora_slot)
        ordered = decodes + prefills
        input_ids, positions, slots = self._flat_inputs(decodes, prefills)
        meta = self._attention_metadata(decodes, prefills, slots)
        hidden = None
        if self.graphs is not None and decodes and not prefills:
            hidden = self.graphs.run(input_ids, positions, slots, meta.decode_block_tables,
                                     meta.decode_seq_lens)
        if hidden is None:
            hidden = self._forward(input_ids, positions, meta, ordered)

        # Rows to compute logits for: one per completed sequence, every row from the last known
        # token on of chunks with drafts, then prompt-logprob positions.
        sample_rows: list[int] = []
        sample_chunks: list[ScheduledChunk] = []
        verify_rows: list[int] = []
        verify_slices: list[VerifySlice] = []
        prompt_rows: list[torch.Tensor] = []
        prompt_slices: list[PromptLogitsSlice] = []
        pool_chunks: list[ScheduledChunk] = []
        pool_spans: list[PoolSpan] = []
        offset = 0
        for chunk in ordered:
            if chunk.request.pooling is not None:
                if chunk.completes_sequence:
                    pool_chunks.append(chunk)
                    pool_spans.append(PoolSpan(offset, chunk.num_new_tokens))
                offset += chunk.num_new_tokens
                continue
            if chunk.completes_sequence:
                first = max(chunk.start, chunk.request.num_tokens - 1)
                if first == chunk.end - 1:
                    sample_rows.append(offset + chunk.num_new_tokens - 1)
                    sample_chunks.append(chunk)
                else:
                    verify_slices.append(VerifySlice(chunk, len(verify_rows), chunk.end - first))
                    verify_rows.extend(range(offset + first - chunk.start, offset + chunk.num_new_tokens))
            request = chunk.request
            if request.wants_prompt_logprobs:
                # Position p scores prompt token p + 1; skip tokens already scored before a
                # preemption made the sequence recompute.
                first = max(chunk.start, request.num_prompt_logprobs_done)
                last = min(chunk.end, request.num_prompt_tokens - 1)
                if last > first:
                    prompt_slices.append(PromptLogitsSlice(chunk, first + 1, 0, last - first))
                    prompt_rows.append(torch.arange(offset + first - chunk.start,
                                                    offset + last - chunk.start))
            offset += chunk.num_new_tokens
        row_index = torch.tensor(sample_rows + verify_rows, dtype=torch.long)
        for piece in verify_slices:
            piece.row_start += len(sample_rows)
        next_row = len(row_index)
        for piece in prompt_slices:
            piece.row_start = next_row
            next_row += piece.num_rows
        if prompt_rows:
            row_index = torch.cat([row_index, *prompt_rows])
        if row_index.numel():
            logits = self.model.compute_logits(hidden[row_index.to(self.device)]).float()
        else:
            logits = hidden.new_empty(0, 0, dtype=torch.float32)
        output = RunnerOutput(logits, sample_chunks, prompt_slices, verify_slices)
        if pool_chunks:
            output.pooled = list(zip(pool_chunks, self._pool(hidden, pool_chunks, pool_spans)))
        return output

    def _plain_decode(self, chunks: list[ScheduledChunk]) -> RunnerOutput | None:
        """The common step, in fewer operations: every chunk one token of a sequence that then
        samples its next token (no drafts, pooling, prompt logprobs or adapters). Its inputs are
        one tensor made in one call and viewed in parts, and every row is sampled in order, so no
        row gather. The general path's two dozen small tensor operations took about 30 us of a
        180 us single-sequence step on the tiny test model, and more in a real step, whose weights
        have just streamed through the caches. Returns None for any other step."""
        if self.lora is not None or not self.has_kv_cache or not chunks:
            return None
        ids: list[int] = []
        for chunk in chunks:
            request = chunk.request
            position = chunk.start
            if (chunk.num_new_tokens != 1 or chunk.spec_token_ids or request.pooling is not None
                    or request.wants_prompt_logprobs or position + 1 != request.num_tokens):
                return None
            ids.append(request.all_token_ids[position])
        return RunnerOutput(self._decode_rows(chunks, ids, 0), list(chunks), [], [])

    def decode_next(self, chunks: list[ScheduledChunk], step: int, token_ids: list[int]) -> torch.Tensor:
        """The `step`-th forward (from 1) of a multi-step run that started as a plain decode of
        `chunks`: row i computes token_ids[i], sampled from the forward before, at position
        chunk.start + step, in a slot the scheduler allocated for the run. Returns the rows'
        logits, (rows, vocab) float32."""
        return _in_inference_mode(self._decode_rows, chunks, token_ids, step)

    def greedy_steps(self, chunks: list[ScheduledChunk], token_ids: list[int], steps: int,
                     stop_ids: list[list[int]], live: list[bool]) -> list[list[int]] | None:
        """Forwards 1..steps of a multi-step run whose rows all decode greedily (no logprobs, no
        logit processors), in one compiled call (DecodeStackModel.greedy_steps): what decode_next
        and the sampler's argmax would give, step by step, without Python between the forwards.
        Returns each forward's tokens, one per row, fewer than `steps` once every row has chosen
        one of its `stop_ids` (or was not `live`); None where that call does not apply (not the
        CPU's decode stack, or an LM head without a compiled kernel)."""
        body = getattr(self.model, "model", None)
        if (not self.on_cpu or self.graphs is not None or not isinstance(body, DecodeStackModel)
                or len(chunks) > body.decode_stack_rows
                or (body.lora_context is not None and body.lora_context.active)):
            return None
        head = self._current_greedy_head(body)
        if head is None:
            return None
        width = max(len(chunk.block_ids) for chunk in chunks)
        tables = [chunk.block_ids + [0] * (width - len(chunk.block_ids)) for chunk in chunks]
        stops = max(1, max(len(ids) for ids in stop_ids))
        stop_table = [ids + [-1] * (stops - len(ids)) for ids in stop_ids]
        tokens = _in_inference_mode(
            body.greedy_steps, head, torch.tensor(token_ids, dtype=torch.long),
            torch.tensor([chunk.start + 1 for chunk in chunks], dtype=torch.long),
            torch.tensor(tables, dtype=torch.long), self.block_size, steps,
            torch.tensor(stop_table, dtype=torch.long), torch.tensor(live, dtype=torch.bool))
        return tokens.tolist()

    def prepare_greedy_head(self) -> None:
        """Make the LM head's int8 copy for greedy runs now (~0.5 s on the 125M reference model;
        the copy holds half a bfloat16 head's bytes), not in the first greedy request's time."""
        body = getattr(self.model, "model", None)
        if self.on_cpu and self.graphs is None and isinstance(body, DecodeStackModel):
            _in_inference_mode(self._current_greedy_head, body)

    def drop_greedy_head_copy(self) -> None:
        """The LM head's weights are about to change (weight sync): drop its int8 copy for good
        (screened_head.drop_screen) and look the head up again at the next greedy run."""
        head = getattr(self.model, "lm_head", None)
        if head is not None:
            drop_screen(head)
        self._greedy_head = None

    def _current_greedy_head(self, body: DecodeStackModel) -> GreedyHead | None:
        if self._greedy_head is None or self._greedy_head[0] is not body.decode_stack:
            self._greedy_head = (body.decode_stack, greedy_head(self.model))  # per stack: rebuilt on a new cache
        return self._greedy_head[1]

    def _decode_rows(self, chunks: list[ScheduledChunk], ids: list[int], step: int) -> torch.Tensor:
        size = self.block_size
        pos: list[int] = []
        slots: list[int] = []
        lengths: list[int] = []
        for chunk in chunks:
            position = chunk.start + step
            pos.append(position)
            slots.append(chunk.block_ids[position // size] * size + position % size)
            lengths.append(position + 1)
        rows = len(ids)
        # Only the blocks that hold tokens so far; later blocks of a table are still empty.
        width = -(-max(lengths) // size)
        flat = ids + pos + slots + lengths
        for chunk in chunks:
            table = chunk.block_ids[:width]
            flat += table
            if len(table) < width:
                flat += [0] * (width - len(table))
        # From an array: a third of torch.tensor's time on a list. Each tensor operation here costs
        # several microseconds in a step whose weights have just streamed through the caches.
        values = torch.frombuffer(array("q", flat), dtype=torch.long)
        if not self.on_cpu:
            values = values.to(self.device)
        input_ids, positions, slot_mapping, seq_lens, tables = values.split((rows, rows, rows, rows, rows * width))
        meta = AttentionMetadata(slot_mapping=slot_mapping, num_decodes=rows,
                                 decode_block_tables=tables.view(rows, width), decode_seq_lens=seq_lens)
        hidden = None
        if self.graphs is not None:
            hidden = self.graphs.run(input_ids, positions, slot_mapping, meta.decode_block_tables, seq_lens)
        if hidden is None:
            hidden = self.model(input_ids, positions, meta)
        return self.model.compute_logits(hidden).float()

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 ordered: list[ScheduledChunk]) -> torch.Tensor:
        if self.lora is not None:
            self.lora.context.set(lora_segments(ordered))
        try:
            return self.model(input_ids, positions, meta)
        finally:
            if self.lora is not None:
                self.lora.context.set([])

    def _as_decode_rows(self, chunk: ScheduledChunk) -> bool:
        """Whether a chunk's tokens run as decode rows (one row each, attending through the paged
        KV up to itself): one token, drafts to verify, or a few more tokens of a sequence that
        already has KV - a draft model catching up on the target's bonus token, a prompt's tail
        after a prefix-cache hit. Those rows take the compiled decode stack on the CPU, where a
        prefill of 2-4 tokens costs as much as that many separate decode steps. Without a KV cache
        a prompt is always a prefill: there is nothing to decode from."""
        if not self.has_kv_cache:
            return False
        return (chunk.num_new_tokens == 1 or bool(chunk.spec_token_ids)
                or (chunk.start > 0 and chunk.num_new_tokens <= SMALL_CHUNK_DECODE_ROWS))

    def _pool(self, hidden: torch.Tensor, chunks: list[ScheduledChunk], spans: list[PoolSpan]
              ) -> list[torch.Tensor]:
        """One float32 CPU vector per pooling request: the class logits, or the embedding."""
        config = self.pooling
        pooled = pool(hidden, spans, config.method)  # (B, hidden)
        results: list[torch.Tensor | None] = [None] * len(chunks)
        classify = [i for i, c in enumerate(chunks) if c.request.pooling.task == "classify"]
        if classify:
            logits = self.model.classify(pooled[classify]).float()
            for row, i in enumerate(classify):
                results[i] = logits[row]
        embed = [i for i, c in enumerate(chunks) if c.request.pooling.task != "classify"]
        if embed:
            dims = [chunks[i].request.pooling.dimensions for i in embed]
            for i, vector in zip(embed, finish_embeddings(pooled[embed], dims, config.normalize)):
                results[i] = vector
        return [r.cpu() for r in results]

    def _flat_inputs(self, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        size = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for chunk in decodes:  # scalar bookkeeping is cheapest for single tokens
            for position in range(chunk.start, chunk.end):
                ids.append(chunk.token_at(position))
                pos.append(position)
                slots.append(chunk.block_ids[position // size] * size + position % size)
        parts_ids = [torch.tensor(ids, dtype=torch.long)]
        parts_pos = [torch.tensor(pos, dtype=torch.long)]
        parts_slots = [torch.tensor(slots, dtype=torch.long)]
        for chunk in prefills:
            positions = torch.arange(chunk.start, chunk.end)
            parts_ids.append(torch.tensor(chunk.request.all_token_ids[chunk.start:chunk.end]))
            parts_pos.append(positions)
            if not self.has_kv_cache:  # nothing is written anywhere
                parts_slots.append(torch.zeros(chunk.num_new_tokens, dtype=torch.long))
                continue
            table = torch.tensor(chunk.block_ids, dtype=torch.long)
            parts_slots.append(table[positions // size] * size + positions % size)
        device = self.device
        return (torch.cat(parts_ids).to(device), torch.cat(parts_pos).to(device),
                torch.cat(parts_slots).to(device))

    def _attention_metadata(self, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk],
                            slots: torch.Tensor) -> AttentionMetadata:
        size, device = self.block_size, self.device
        meta = AttentionMetadata(slot_mapping=slots, num_decodes=sum(c.num_new_tokens for c in decodes))
        if decodes:
            # One row per token; the rows of a chunk share its table and each attends up to itself.
            tables = [c.block_ids for c in decodes for _ in range(c.num_new_tokens)]
            # Only the blocks that hold tokens so far; later blocks of a table are still empty.
            lengths = [position + 1 for c in decodes for position in range(c.start, c.end)]
            width = max(-(-n // size) for n in lengths)
            padded = [t[:width] + [0] * (width - len(t[:width])) for t in tables]
            meta.decode_block_tables = torch.tensor(padded, dtype=torch.long, device=device)
            meta.decode_seq_lens = torch.tensor(lengths, device=device)
        offset = meta.num_decodes
        for chunk in prefills:
            span = PrefillSpan(offset, chunk.num_new_tokens, chunk.start, None, None)
            if chunk.start > 0:
                total = chunk.end
                blocks = chunk.block_ids[:-(-total // size)]
                span.block_table = torch.tensor(blocks, dtype=torch.long, device=device)
                query_positions = torch.arange(chunk.start, chunk.end, device=device)
                span.mask = torch.arange(total, device=device)[None, :] <= query_positions[:, None]
            meta.prefills.append(span)
            offset += chunk.num_new_tokens
        return meta


def _in_inference_mode(function, *args):
    """function(*args) under torch.inference_mode, entered only when not already on (the engine
    process's loop runs in it throughout)."""
    if torch.is_inference_mode_enabled():
        return function(*args)
    with torch.inference_mode():
        return function(*args)


def lora_segments(ordered: list[ScheduledChunk]) -> list[tuple[int, int, int]]:
    """(first row, end row, slot) runs of tokens that use an adapter, over the flat batch."""
    segments: list[tuple[int, int, int]] = []
    offset = 0
    for chunk in ordered:
        slot, end = chunk.request.lora_slot, offset + chunk.num_new_tokens
        if slot >= 0:
            if segments and segments[-1][1] == offset and segments[-1][2] == slot:
                segments[-1] = (segments[-1][0], end, slot)
            else:
                segments.append((offset, end, slot))
        offset = end
    return segments
