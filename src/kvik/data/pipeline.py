"""`kvik data run`: read, clean, deduplicate, tokenize and shard, then report.

Outputs in `output_dir`: documents.jsonl (kept, cleaned), dropped.jsonl (every dropped document with
its reason), tokenizer/, the shards and manifest.json (see `kvik.data.shards`), report.json,
report.txt and report.png.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TextIO

from kvik.data.config import PipelineConfig
from kvik.data.document import BatchResult, Document, Dropped
from kvik.data.exact_dedup import ExactDuplicateIndex
from kvik.data.minhash import NearDuplicateIndex
from kvik.data.readers import read_documents
from kvik.data.report import PipelineCounts, build_report, write_report
from kvik.data.shards import eos_token_id, prepare_tokenizer, write_manifest, write_shards
from kvik.data.stages import STAGES, process_batch


@dataclass(frozen=True, slots=True)
class PipelineResult:
    output_dir: Path
    report: dict[str, Any]
    manifest: dict[str, Any] | None  # None when tokenization was skipped


def _batched(docs: Iterable[Document], size: int) -> Iterator[list[Document]]:
    batch: list[Document] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _ordered_map(fn: Callable[[list[Document]], BatchResult], batches: Iterator[list[Document]],
                 workers: int) -> Iterator[BatchResult]:
    """fn over batches in worker processes, results in input order, at most 2 batches per worker
    in flight (Pool.imap would read the whole input into its task queue)."""
    if workers == 1:
        yield from map(fn, batches)
        return
    # spawn, not fork: the parent may hold tokenizer threads, which do not survive a fork.
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pending: deque[Any] = deque()
        for batch in batches:
            pending.append(pool.apply_async(fn, (batch,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _write_dropped(out: TextIO, dropped: Dropped) -> None:
    out.write(json.dumps({"id": dropped.id, "source": dropped.source, "stage": dropped.stage,
                          "reason": dropped.reason, "detail": dropped.detail, "text": dropped.text},
                         ensure_ascii=False) + "\n")


def clean_documents(config: PipelineConfig, out_dir: Path, progress: bool) -> PipelineCounts:
    """The cleaning pass: documents.jsonl and dropped.jsonl; returns the counts."""
    from tqdm import tqdm

    counts = PipelineCounts(STAGES)
    exact = ExactDuplicateIndex() if config.exact_dedup.enabled else None
    near = NearDuplicateIndex(config.near_dedup) if config.near_dedup.enabled else None
    batches = _batched(read_documents(config.inputs), config.batch_size)
    results = _ordered_map(partial(process_batch, config=config), batches, config.workers)
    with (open(out_dir / "documents.jsonl", "w", encoding="utf-8") as kept_file,
          open(out_dir / "dropped.jsonl", "w", encoding="utf-8") as dropped_file,
          tqdm(desc="cleaning", unit="doc", disable=not progress, file=sys.stderr) as bar):
        for result in results:
            counts.input_documents += len(result.kept) + len(result.dropped)
            counts.add_edits(result.edits)
            dropped = list(result.dropped)
            for doc, hashvalues in zip(result.kept, result.signatures):
                earlier = exact.add(doc.id, doc.text) if exact else None
                similar = near.add(doc.id, hashvalues) if near and not earlier else None
                if earlier:
                    dropped.append(Dropped(doc.id, doc.source, "exact_dedup/duplicate", doc.text,
                                           f"same text as {earlier}"))
                elif similar:
                    dropped.append(Dropped(doc.id, doc.source, "near_dedup/near_duplicate", doc.text,
                                           f"jaccard {similar.similarity:.2f} with {similar.of}"))
                else:
                    kept_file.write(json.dumps({"id": doc.id, "source": doc.source, "text": doc.text},
                                               ensure_ascii=False) + "\n")
            for item in dropped:
                counts.add_dropped(item)
                _write_dropped(dropped_file, item)
            bar.update(len(result.kept) + len(result.dropped))
    return counts


def _kept_texts(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            yield json.loads(line)["text"]


def _remove_stale_outputs(out_dir: Path) -> None:
    """A previous run may have written more shards than this one will; none may survive it."""
    for pattern in ("train-*.bin", "val-*.bin", "manifest.json"):
        for path in out_dir.glob(pattern):
            path.unlink()


def run_pipeline(config: PipelineConfig, *, tokenize: bool = True,
                 progress: bool = True) -> PipelineResult:
    """Run the whole pipeline described by `config`; timings are printed, never written."""
    out_dir = Path(config.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_outputs(out_dir)
    start = time.perf_counter()
    counts = clean_documents(config, out_dir, progress)
    cleaned_at = time.perf_counter()
    manifest = None
    tokens = None
    if tokenize:
        documents = out_dir / "documents.jsonl"
        tokenizer_dir = out_dir / "tokenizer"
        tokenizer = prepare_tokenizer(config.tokenizer, _kept_texts(documents), tokenizer_dir)
        eos = eos_token_id(tokenizer_dir, tokenizer)
        splits = write_shards(_kept_texts(documents), counts.output_documents, tokenizer, eos, out_dir,
                              config.shards)
        manifest = write_manifest(out_dir, tokenizer_dir, tokenizer, eos, splits, config.to_dict(),
                                  counts.input_documents)
        tokens = {name: {"documents": s["documents"], "tokens": s["tokens"]}
                  for name, s in splits.items()}
    report = build_report(counts, tokens, manifest["version"] if manifest else None)
    write_report(report, out_dir)
    if progress:
        print(f"cleaned {counts.input_documents} documents in {cleaned_at - start:.1f}s, "
              f"tokenized in {time.perf_counter() - cleaned_at:.1f}s", file=sys.stderr)
    return PipelineResult(out_dir, report, manifest)
