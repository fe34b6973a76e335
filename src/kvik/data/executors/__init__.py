"""Where the pipeline's work runs: `local` (worker processes on this machine) or `ray` (a Ray
cluster). Both run the same per-batch stages and the same deduplication rules and write the same
bytes; the executor is a run option, not part of pipeline.yaml, so it never changes the outputs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvik.core.errors import ConfigError
from kvik.data.executors.base import Deduplicator, Executor

EXECUTORS = ("local", "ray")

__all__ = ["EXECUTORS", "Deduplicator", "Executor", "ExecutorSpec", "open_executor"]


@dataclass(frozen=True, slots=True)
class ExecutorSpec:
    kind: str = "local"  # local | ray
    # ray: the cluster to join ("HOST:PORT", "ray://HOST:PORT", "auto", "local"); None follows Ray's
    # own lookup: $RAY_ADDRESS, then the latest cluster started on this machine, else a new local one.
    ray_address: str | None = None
    # ray: actors each deduplication index is split into (exact: by digest, near: by LSH band);
    # None: one per node of the cluster.
    dedup_shards: int | None = None


@contextmanager
def open_executor(spec: ExecutorSpec, workers: int) -> Iterator[Executor]:
    """The executor `spec` names, closed on exit. `workers`: processes of the local executor."""
    if spec.kind == "local":
        from kvik.data.executors.local import LocalExecutor

        executor: Executor = LocalExecutor(workers)
    elif spec.kind == "ray":
        from kvik.data.executors.ray_cluster import RayExecutor

        executor = RayExecutor(spec.ray_address, spec.dedup_shards)
    else:
        raise ConfigError(f"--executor: {spec.kind!r} is not one of {', '.join(EXECUTORS)}")
    try:
        yield executor
    finally:
        executor.close()
