"""`kvik bench serve` as a function: build the workload, run the load, summarize, one JSON document.

The CLI, and scripts that sweep request rates or compare servers, call `run_serve_benchmark` and get
the same document `--json` writes: {label, date, config, summary, requests}.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import math
from pathlib import Path
from typing import Any

from kvik.bench.load import LoadConfig, fetch_vocab_size, run_load
from kvik.bench.stats import SLO, RequestRecord, summarize
from kvik.bench.workloads import WorkloadSpec, build_workload


def run_serve_benchmark(spec: WorkloadSpec, config: LoadConfig, slo: SLO, label: str | None = None,
                        vocab_size: int | None = None) -> dict[str, Any]:
    """Run one benchmark; token-id workloads ask the server for `vocab_size` when it is not given."""
    chat = config.endpoint == "chat"
    if vocab_size is None and not chat and spec.kind in ("random", "prefix"):
        vocab_size = asyncio.run(fetch_vocab_size(config.base_url, config.api_key))
    requests = build_workload(spec, chat, vocab_size)
    result = asyncio.run(run_load(requests, config))
    return result_document(spec, config, slo, label, vocab_size, result.records, result.duration_s)


def result_document(spec: WorkloadSpec, config: LoadConfig, slo: SLO, label: str | None,
                    vocab_size: int | None, records: list[RequestRecord],
                    duration_s: float) -> dict[str, Any]:
    """The `--json` document: label, date, the run's config, its summary and every request's record."""
    run_config: dict[str, Any] = {
        "base_url": config.base_url, "model": config.model, "endpoint": config.endpoint,
        "workload": spec.kind, "num_prompts": spec.num_prompts,
        "input_len_range": list(spec.input_len_range), "output_len_range": list(spec.output_len_range),
        "prefix_len": spec.prefix_len, "question_len": spec.question_len, "seed": spec.seed,
        # JSON has no infinity; plots skip runs whose rate is not a number.
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "max_concurrency": config.max_concurrency, "vocab_size": vocab_size,
    }
    return {"label": label, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "config": run_config, "summary": summarize(records, duration_s, slo),
            "requests": [r.to_json() for r in records]}


def run_title(document: dict[str, Any]) -> str:
    """'kvik | random | rate 4 req/s | concurrency 2': the heading of the printed table."""
    config = document["config"]
    rate = config["request_rate"]
    title = f"{document['label'] or config['model']} | {config['workload']} | rate "
    title += "inf" if rate == "inf" else f"{rate:g} req/s"
    if config["max_concurrency"]:
        title += f" | concurrency {config['max_concurrency']}"
    return title


def write_document(document: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
