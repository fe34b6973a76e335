"""The per-batch stages: a pure function from a batch of documents to kept and dropped ones.

Nothing here touches files or global state, so a batch can run in any worker process or on any
node of a Ray cluster (`kvik.data.executors`) and give the same result.
"""

from __future__ import annotations

from kvik.data.config import PipelineConfig
from kvik.data.document import BatchResult, Document, Dropped
from kvik.data.exact_dedup import text_digest
from kvik.data.filters import c4, fineweb, gopher_quality, gopher_repetition
from kvik.data.minhash import signature
from kvik.data.normalize import normalize_text
from kvik.data.pii import scrub

# Order in which documents meet the stages, as in FineWeb's pipeline; the report lists them so.
PER_BATCH_STAGES = ("normalize", "gopher_repetition", "gopher_quality", "c4", "fineweb", "pii")
GLOBAL_STAGES = ("exact_dedup", "near_dedup")
STAGES = PER_BATCH_STAGES + GLOBAL_STAGES


def _quality_verdict(text: str, config: PipelineConfig, result: BatchResult) -> tuple[str, str, str]:
    """Run the quality filters in order: (text after C4's line edits, reason or "" to keep, detail)."""
    if config.gopher_repetition.enabled and (r := gopher_repetition.check(text, config.gopher_repetition)):
        return text, f"gopher_repetition/{r.rule}", r.detail
    if config.gopher_quality.enabled and (r := gopher_quality.check(text, config.gopher_quality)):
        return text, f"gopher_quality/{r.rule}", r.detail
    if config.c4.enabled:
        outcome = c4.check(text, config.c4)
        if outcome.rejection:
            return text, f"c4/{outcome.rejection.rule}", outcome.rejection.detail
        result.count_edit("c4/lines_removed", outcome.lines_removed)
        text = outcome.text
    if config.fineweb.enabled and (r := fineweb.check(text, config.fineweb)):
        return text, f"fineweb/{r.rule}", r.detail
    return text, "", ""


def process_batch(docs: list[Document], config: PipelineConfig) -> BatchResult:
    """Normalise, filter and scrub `docs`; compute the survivors' digests and MinHash signatures."""
    result = BatchResult()
    for doc in docs:
        text = normalize_text(doc.text, config.normalize)
        if not text.strip():
            reason, detail = "normalize/empty", "no text after normalisation"
        else:
            text, reason, detail = _quality_verdict(text, config, result)
        if reason:
            result.dropped.append(Dropped(doc.id, doc.source, reason, doc.text, detail))
            continue
        if config.pii.enabled:
            scrubbed = scrub(text, config.pii)
            text = scrubbed.text
            result.count_edit("pii/emails", scrubbed.emails)
            result.count_edit("pii/phones", scrubbed.phones)
            result.count_edit("pii/ips", scrubbed.ips)
        result.kept.append(Document(doc.id, text, doc.source))
        result.signatures.append(signature(text, config.near_dedup) if config.near_dedup.enabled
                                 else None)
        result.digests.append(text_digest(text) if config.exact_dedup.enabled else None)
    return result
