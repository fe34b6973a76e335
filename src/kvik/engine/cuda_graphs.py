"""CUDA graphs for decode steps: the model's forward over decode rows, recorded once per shape and
replayed.

A decode step of a small model on a fast GPU is bound by launching kernels, not by running them: a
1B Llama issues a few hundred small kernels per token, each costing the CPU several microseconds to
launch, while the GPU finishes each in less. A CUDA graph records those launches once and replays
them with one call. A graph replays fixed shapes and fixed addresses, so:

- the step's inputs (token ids, positions, cache slots, block tables, sequence lengths) are copied
  into static buffers allocated once, and the graph reads them there;
- the number of rows is rounded up to a captured batch size (1, 2, 4, 8, 16, 24, 32, ... 512) and
  the block-table width up to a power of two (at most the blocks of max_model_len); padding rows decode token 0 at position 0, write
  their keys and values to a slot of one spare KV block that no sequence owns, and attend to one
  key, so they cost little and touch nothing of anyone's;
- each (rows, width) pair is captured on first use, in a memory pool the graphs share (they never
  run concurrently), so a server that only ever runs a few shapes records only those.

Only steps whose every token is a decode row use a graph (single-token decodes, speculative
verification rows, a draft model's short catch-up chunks). Prefill and mixed steps, LoRA adapters
and CPU devices run eagerly. `--enforce-eager` turns graphs off. On the CPU the same padded path can
run without capture (`GraphSettings(capture=False)`), which is how the padding is tested on machines
without a GPU. Measured on an H200 (bench/decode_graphs.py, a 1.1B Llama in bfloat16): 5.4x the
eager engine's decode speed at batch 1, 4.4x at 16, 3.2x at 64.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvik.model.layers.attention import AttentionMetadata

logger = logging.getLogger("kvik.engine")

# Row counts captured (a step is rounded up to the next one); past the last, steps run eagerly.
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@dataclass(frozen=True, slots=True)
class GraphSettings:
    max_rows: int  # most decode rows a graph covers (larger steps run eagerly)
    max_model_len: int  # longest sequence: the block tables' widest bucket
    capture: bool = True  # False: run the padded static buffers eagerly (tests without a GPU)

    def __post_init__(self) -> None:
        if not 1 <= self.max_rows <= GRAPH_BATCH_SIZES[-1]:
            raise ValueError(f"max_rows must be 1 to {GRAPH_BATCH_SIZES[-1]}, not {self.max_rows}")


def decode_graph_settings(device: torch.device, *, enforce_eager: bool, max_model_len: int,
                          max_rows: int) -> GraphSettings | None:
    """Graphs for the decode steps of a model on `device`, or None where steps run eagerly."""
    if device.type != "cuda" or enforce_eager:
        return None
    return GraphSettings(max_rows=min(max_rows, GRAPH_BATCH_SIZES[-1]), max_model_len=max_model_len)


class DecodeGraphs:
    """The model's forward over decode rows through static buffers, one CUDA graph per shape."""

    def __init__(self, model: nn.Module, settings: GraphSettings, *, block_size: int, pad_slot: int,
                 device: torch.device) -> None:
        self.model = model
        self.capture = settings.capture
        self.pad_slot = pad_slot
        self.batch_sizes = [n for n in GRAPH_BATCH_SIZES if n < settings.max_rows]
        self.batch_sizes.append(settings.max_rows)
        max_blocks = -(-settings.max_model_len // block_size)
        widths, width = [], 1
        while width < max_blocks:
            widths.append(width)
            width *= 2
        self.widths = widths + [max_blocks]
        rows = self.batch_sizes[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.full((rows,), pad_slot, dtype=torch.long, device=device)
        self.tables = torch.zeros(rows, max_blocks, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.long, device=device)
        # (rows, width) -> (graph, its output); the output lives in the graphs' pool.
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.pool: Any = None
        self.failed = False  # a capture failed (out of memory): every step runs eagerly from then on
        self.replays = 0  # steps served by a graph (or by the padded path, without capture)

    def shape_for(self, rows: int, width: int) -> tuple[int, int] | None:
        """The captured (rows, width) a step of this size runs as, or None if it is too large."""
        if self.failed or rows > self.batch_sizes[-1] or width > self.widths[-1]:
            return None
        return (self.batch_sizes[bisect.bisect_left(self.batch_sizes, rows)],
                self.widths[bisect.bisect_left(self.widths, width)])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor | None:
        """Hidden states (rows, hidden) of one decode-only step, or None when it must run eagerly.
        The result is a view of the graph's output: use it before the next step."""
        rows, width = tables.shape
        shape = self.shape_for(rows, width)
        if shape is None:
            return None
        padded_rows, padded_width = shape
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        self.slots[:rows].copy_(slots)
        self.tables[:rows, :width].copy_(tables)
        self.seq_lens[:rows].copy_(seq_lens)
        if padded_width > width:  # columns a row does not use must still name a real block
            self.tables[:rows, width:padded_width].zero_()
        if padded_rows > rows:  # rows left over from a larger step become padding again
            self.input_ids[rows:padded_rows].zero_()
            self.positions[rows:padded_rows].zero_()
            self.slots[rows:padded_rows].fill_(self.pad_slot)
            self.tables[rows:padded_rows, :padded_width].zero_()
            self.seq_lens[rows:padded_rows].fill_(1)
        if not self.capture:
            hidden = self._forward(padded_rows, padded_width)
        else:
            entry = self.graphs.get(shape)
            if entry is None:
                entry = self._capture(padded_rows, padded_width)
                if entry is None:
                    return None
            graph, hidden = entry
            graph.replay()
        self.replays += 1
        return hidden[:rows]

    def _forward(self, rows: int, width: int) -> torch.Tensor:
        # A fresh metadata object each time: attention builds its mask lazily into it, and a
        # captured graph must compute the mask from the static lengths, not keep an old one.
        # The table columns as one contiguous tensor, as the step's own tables are (the compiled CPU
        # attention reads them as such; in a graph the copy is one more recorded kernel).
        meta = AttentionMetadata(slot_mapping=self.slots[:rows], num_decodes=rows,
                                 decode_block_tables=self.tables[:rows, :width].contiguous(),
                                 decode_seq_lens=self.seq_lens[:rows])
        return self.model(self.input_ids[:rows], self.positions[:rows], meta)

    def _capture(self, rows: int, width: int) -> tuple[Any, torch.Tensor] | None:
        """Record the forward for this shape. Warm-up runs first on a side stream (as PyTorch asks):
        they write the same keys and values to the same slots as the step itself will."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(rows, width)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                hidden = self._forward(rows, width)
        except torch.cuda.OutOfMemoryError:
            logger.warning("CUDA graph capture for %d decode rows x %d blocks ran out of memory; decode "
                           "steps run eagerly from now on", rows, width)
            self.failed = True
            self.graphs.clear()
            torch.cuda.empty_cache()
            return None
        self.graphs[(rows, width)] = (graph, hidden)
        logger.info("captured a CUDA graph for %d decode rows x %d blocks (%d graphs)", rows, width,
                    len(self.graphs))
        return graph, hidden
