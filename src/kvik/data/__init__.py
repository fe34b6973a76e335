"""The data pipeline behind `kvik data`: raw text in, cleaned documents and token shards out.

Stages are pure functions over batches of `Document`s (normalise, quality filters, PII scrubbing,
digests and signatures), run in worker processes or on a Ray cluster (`kvik.data.executors`); the two
global steps (exact and near-duplicate removal) see documents in input order, so the result depends
on neither the number of workers nor the executor. Training meets this package only at files:
`manifest.json` and the binary shards it lists (see `kvik.data.shards`).
"""
