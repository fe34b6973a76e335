"""The data pipeline behind `kvik data`: raw text in, cleaned documents and token shards out.

Stages are pure functions over batches of `Document`s (normalise, quality filters, PII scrubbing,
signatures), run in worker processes; the two global steps (exact and near-duplicate removal) run in
the parent in document order, so the result does not depend on the number of workers. Training meets
this package only at files: `manifest.json` and the binary shards it lists (see `kvik.data.shards`).
"""
