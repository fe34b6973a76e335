"""lm-evaluation-harness against a running OpenAI-compatible server (`kvik serve`), through the
harness's own `local-completions` client: loglikelihood tasks use /v1/completions with `echo` and
`logprobs` on token-id prompts, generation tasks its completions. The harness is an optional
dependency (`pip install 'kvik[eval]'`); tasks whose data is on the hub need network access, local
task YAMLs (`--include-path`) do not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvik.core.errors import ConfigError


def run_harness(base_url: str, model: str, tokenizer: str, tasks: list[str], *,
                include_path: str | None = None, limit: int | None = None,
                num_concurrent: int = 1, batch_size: int = 1) -> dict[str, Any]:
    """Run `tasks` and return the harness's results dict ({"results": {task: {metric: value}}})."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as exc:
        raise ConfigError("lm-evaluation-harness is not installed: pip install 'kvik[eval]' "
                          "(with torch pinned to the build you have)") from exc
    base = base_url.rstrip("/")
    base = base if base.endswith("/v1") else f"{base}/v1"
    model_args = {"base_url": f"{base}/completions", "model": model, "tokenizer_backend": "huggingface",
                  "tokenizer": str(Path(tokenizer)), "tokenized_requests": True,
                  "num_concurrent": num_concurrent, "max_retries": 1, "batch_size": batch_size}
    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    results = lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=tasks,
                                      limit=limit, task_manager=manager, log_samples=False)
    if results is None:
        raise ConfigError("lm-evaluation-harness returned no results")
    return {"results": results["results"], "versions": results.get("versions", {})}
