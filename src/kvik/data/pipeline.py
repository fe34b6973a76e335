"""`kvik data run`: read, clean, deduplicate, tokenize and shard, then report.

Outputs in `output_dir`: documents.jsonl (kept, cleaned), dropped.jsonl (every dropped document with
its reason), tokenizer/, the shards and manifest.json (see `kvik.data.shards`), report.json,
report.txt and report.png.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TextIO

from kvik.data.config import PipelineConfig
from kvik.data.document import Document, Dropped
from kvik.data.executors import Executor, ExecutorSpec, open_executor
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


def _write_dropped(out: TextIO, dropped: Dropped) -> None:
    out.write(json.dumps({"id": dropped.id, "source": dropped.source, "stage": dropped.stage,
                          "reason": dropped.reason, "detail": dropped.detail, "text": dropped.text},
                         ensure_ascii=False) + "\n")


def clean_documents(config: PipelineConfig, out_dir: Path, progress: bool,
                    executor: Executor) -> PipelineCounts:
    """The cleaning pass: documents.jsonl and dropped.jsonl; returns the counts."""
    from tqdm import tqdm

    counts = PipelineCounts(STAGES)
    deduplicator = executor.deduplicator(config)
    batches = _batched(read_documents(config.inputs), config.batch_size)
    results = executor.map_batches(partial(process_batch, config=config), batches)
    with (open(out_dir / "documents.jsonl", "w", encoding="utf-8") as kept_file,
          open(out_dir / "dropped.jsonl", "w", encoding="utf-8") as dropped_file,
          tqdm(desc="cleaning", unit="doc", disable=not progress, file=sys.stderr) as bar):
        for result in results:
            counts.input_documents += len(result.kept) + len(result.dropped)
            counts.add_edits(result.edits)
            dropped = list(result.dropped)
            for doc, duplicate in zip(result.kept, deduplicator.check(result)):
                if duplicate:
                    dropped.append(duplicate)
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


def run_pipeline(config: PipelineConfig, *, tokenize: bool = True, progress: bool = True,
                 executor: ExecutorSpec = ExecutorSpec()) -> PipelineResult:
    """Run the whole pipeline described by `config`; timings are printed, never written. The
    `executor` runs the cleaning and deduplication (tokenization and sharding run here); it does not
    change a byte of the outputs."""
    out_dir = Path(config.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_outputs(out_dir)
    start = time.perf_counter()
    with open_executor(executor, config.workers) as running:
        counts = clean_documents(config, out_dir, progress, running)
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
