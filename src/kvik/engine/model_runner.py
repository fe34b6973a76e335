"""Turn a scheduled step into one batched forward over a flat token batch.

The batch holds every scheduled token of every sequence: one-token decodes first (attended together),
then prefill chunks. Logits are computed only for rows that need them: the last token of each
sequence whose known tokens are now all computed (to sample from), and prompt positions of sequences
that asked for prompt logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kvik.engine.device import advise_huge_pages
from kvik.engine.kv_manager import KVCacheManager
from kvik.engine.scheduler import ScheduledChunk
from kvik.model.layers.attention import AttentionMetadata, PrefillSpan
from kvik.model.layers.kv_cache import PagedKVCache, kv_bytes_per_token
from kvik.model.transforms import bind_kv_cache


@dataclass(slots=True)
class PromptLogitsSlice:
    """Logits rows scoring prompt tokens [first_token, first_token + rows) of one sequence."""

    chunk: ScheduledChunk
    first_token: int
    row_start: int
    num_rows: int


@dataclass(slots=True)
class RunnerOutput:
    logits: torch.Tensor  # (rows, vocab) float32: sampling rows first, then prompt-logprob rows
    sample_chunks: list[ScheduledChunk] = field(default_factory=list)  # row i samples for chunk i
    prompt_slices: list[PromptLogitsSlice] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: nn.Module, kv: KVCacheManager, *, num_layers: int, num_kv_heads: int,
                 head_dim: int, device: torch.device, kv_cache_dtype: torch.dtype) -> None:
        self.model = model
        self.kv = kv
        self.block_size = kv.block_size
        self.device = device
        # One allocation for every layer: (layers, k/v, kv_heads, blocks, block_size, head_dim), plus
        # per-token scales for int8. Huge pages requested before the zeroing touches the memory.
        self.kv_cache = PagedKVCache.empty(num_layers, num_kv_heads, kv.pool.num_blocks, self.block_size,
                                           head_dim, kv_cache_dtype, device)
        advise_huge_pages(self.kv_cache.data)
        self.kv_cache.zero_()
        self.cache_binding = bind_kv_cache(model, self.kv_cache)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return block_size * kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> RunnerOutput:
        decodes = [c for c in chunks if c.num_new_tokens == 1]
        prefills = [c for c in chunks if c.num_new_tokens > 1]
        ordered = decodes + prefills
        input_ids, positions, slots = self._flat_inputs(decodes, prefills)
        meta = self._attention_metadata(decodes, prefills, slots)
        hidden = self.model(input_ids, positions, meta)

        # Rows to compute logits for: one per completed sequence, then prompt-logprob positions.
        sample_rows: list[int] = []
        sample_chunks: list[ScheduledChunk] = []
        prompt_rows: list[torch.Tensor] = []
        prompt_slices: list[PromptLogitsSlice] = []
        offset = 0
        for chunk in ordered:
            if chunk.completes_sequence:
                sample_rows.append(offset + chunk.num_new_tokens - 1)
                sample_chunks.append(chunk)
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
        row_index = torch.tensor(sample_rows, dtype=torch.long)
        next_row = len(sample_rows)
        for piece in prompt_slices:
            piece.row_start = next_row
            next_row += piece.num_rows
        if prompt_rows:
            row_index = torch.cat([row_index, *prompt_rows])
        logits = self.model.compute_logits(hidden[row_index.to(self.device)]).float()
        return RunnerOutput(logits, sample_chunks, prompt_slices)

    def _flat_inputs(self, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        size = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for chunk in decodes:  # scalar bookkeeping is cheapest for single tokens
            position = chunk.start
            table = self.kv.block_tables[chunk.request.seq_id]
            ids.append(chunk.request.all_token_ids[position])
            pos.append(position)
            slots.append(table[position // size].block_id * size + position % size)
        parts_ids = [torch.tensor(ids, dtype=torch.long)]
        parts_pos = [torch.tensor(pos, dtype=torch.long)]
        parts_slots = [torch.tensor(slots, dtype=torch.long)]
        for chunk in prefills:
            positions = torch.arange(chunk.start, chunk.end)
            table = torch.tensor(self.kv.block_ids(chunk.request), dtype=torch.long)
            parts_ids.append(torch.tensor(chunk.request.all_token_ids[chunk.start:chunk.end]))
            parts_pos.append(positions)
            parts_slots.append(table[positions // size] * size + positions % size)
        device = self.device
        return (torch.cat(parts_ids).to(device), torch.cat(parts_pos).to(device),
                torch.cat(parts_slots).to(device))

    def _attention_metadata(self, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk],
                            slots: torch.Tensor) -> AttentionMetadata:
        size, device = self.block_size, self.device
        meta = AttentionMetadata(slot_mapping=slots, num_decodes=len(decodes))
        if decodes:
            tables = [self.kv.block_ids(c.request) for c in decodes]
            # Only the blocks that hold tokens so far; later blocks of a table are still empty.
            lengths = [c.start + 1 for c in decodes]
            width = max(-(-n // size) for n in lengths)
            padded = [t[:width] + [0] * (width - len(t[:width])) for t in tables]
            meta.decode_block_tables = torch.tensor(padded, dtype=torch.long, device=device)
            meta.decode_seq_lens = torch.tensor(lengths, device=device)
        offset = len(decodes)
        for chunk in prefills:
            span = PrefillSpan(offset, chunk.num_new_tokens, chunk.start, None, None)
            if chunk.start > 0:
                total = chunk.end
                blocks = self.kv.block_ids(chunk.request)[:-(-total // size)]
                span.block_table = torch.tensor(blocks, dtype=torch.long, device=device)
                query_positions = torch.arange(chunk.start, chunk.end, device=device)
                span.mask = torch.arange(total, device=device)[None, :] <= query_positions[:, None]
            meta.prefills.append(span)
            offset += chunk.num_new_tokens
        return meta
