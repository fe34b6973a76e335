"""Benchmarks: the online load generator (`kvik bench serve`), latency-vs-load plots (`kvik bench plot`)
and the naive baseline server (FastAPI over HF `generate`, one request at a time) kvik is measured against.

The load generator, statistics and plotting are torch-free so they can drive any OpenAI-compatible
endpoint from a machine without the engine installed.
"""
