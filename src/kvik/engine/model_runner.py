"""Turn a scheduled step into one batched forward over a flat token batch.

The batch holds every scheduled token of every sequence: one-token decodes first (attended together),
then prefill chunks. Logits are computed only for rows that need them: the last token of each
sequence whose known tokens are now all computed (to sample from), and prompt positions of sequences
that asked for prompt logprobs. A pooling request whose prompt is now computed gets its pooled vector
instead (`kvik.model.pooling`): truncated and normalised for embeddings, through the model's score
head for classification. An encoder model has no KV cache (`num_blocks=0`): every chunk is a whole
prompt attended on its own, and no slot mapping is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kvik.engine.device import advise_huge_pages
from kvik.engine.scheduler import ScheduledChunk
from kvik.model.layers.attention import AttentionMetadata, PrefillSpan
from kvik.model.pooling import PoolingConfig, PoolSpan, finish_embeddings, pool
from kvik.model.transforms.cpu_fused_ops import enable_decode_stack


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
    # Pooling requests finished this step: (chunk, 1-D float32 CPU tensor).
    pooled: list[tuple[ScheduledChunk, torch.Tensor]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: nn.Module, *, num_blocks: int, block_size: int, num_layers: int,
                 num_kv_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype,
                 cpu_kernels: Any = None, pooling: PoolingConfig | None = None) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.pooling = pooling
        self.has_kv_cache = num_blocks > 0
        self.uses_cpu_kernel = False
        if not self.has_kv_cache:  # an encoder
            self.kv_cache = None
            return
        # One allocation for every layer: (layers, k/v, kv_heads, blocks, block_size, head_dim).
        # Zeroed so that padding slots read by the batched gather are finite (masked afterwards);
        # huge pages requested before the zeroing touches the memory.
        self.kv_cache = torch.empty(num_layers, 2, num_kv_heads, num_blocks, self.block_size, head_dim,
                                    device=device, dtype=dtype)
        advise_huge_pages(self.kv_cache)
        self.kv_cache.zero_()
        kernel = cpu_kernels if device.type == "cpu" and dtype == torch.float32 else None
        self.uses_cpu_kernel = kernel is not None
        for layer_index, attention in enumerate(model.attention_layers()):
            attention.kv_cache = self.kv_cache[layer_index]
            attention.decode_kernel = kernel
        if kernel is not None:
            enable_decode_stack(model, kernel)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> RunnerOutput:
        # Without a KV cache a one-token prompt is a (tiny) prefill: there is nothing to decode from.
        decodes = [c for c in chunks if c.num_new_tokens == 1 and self.has_kv_cache]
        prefills = [c for c in chunks if c.num_new_tokens > 1 or not self.has_kv_cache]
        ordered = decodes + prefills
        input_ids, positions, slots = self._flat_inputs(decodes, prefills)
        meta = self._attention_metadata(decodes, prefills, slots)
        hidden = self.model(input_ids, positions, meta)

        # Rows to compute logits for: one per completed sequence, then prompt-logprob positions.
        sample_rows: list[int] = []
        sample_chunks: list[ScheduledChunk] = []
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
        if row_index.numel():
            logits = self.model.compute_logits(hidden[row_index.to(self.device)]).float()
        else:
            logits = hidden.new_empty(0, 0, dtype=torch.float32)
        output = RunnerOutput(logits, sample_chunks, prompt_slices)
        if pool_chunks:
            output.pooled = list(zip(pool_chunks, self._pool(hidden, pool_chunks, pool_spans)))
        return output

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
            position = chunk.start
            ids.append(chunk.request.all_token_ids[position])
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
        meta = AttentionMetadata(slot_mapping=slots, num_decodes=len(decodes))
        if decodes:
            tables = [c.block_ids for c in decodes]
            # Only the blocks that hold tokens so far; later blocks of a table are still empty.
            lengths = [c.start + 1 for c in decodes]
            width = max(-(-n // size) for n in lengths)
            padded = [t[:width] + [0] * (width - len(t[:width])) for t in tables]
            meta.decode_block_tables = torch.tensor(padded, dtype=torch.long, device=device)
            key_positions = torch.arange(width * size, device=device)
            seq_lens = torch.tensor(lengths, device=device)
            meta.decode_seq_lens = seq_lens
            if not self.uses_cpu_kernel:
                meta.decode_mask = (key_positions[None, :] < seq_lens[:, None])[:, None, None, :]
        offset = len(decodes)
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
