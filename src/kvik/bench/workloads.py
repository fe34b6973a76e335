"""Benchmark workloads: what each request asks for (prompt, output length), built once before the run.

All randomness comes from one `random.Random(seed)`, so the same flags give the same prompts and output
lengths on every run and against every server (kvik, the naive baseline, vLLM), which is what makes
their figures comparable. Token-id prompts go to /v1/completions; chat endpoints get random words,
whose token counts are only approximate (the server's usage chunk reports the real ones).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvik.core.errors import ConfigError
from kvik.core.jsonl import jsonl_values

# Common English words: about one token each in real BPE vocabularies, so N words is roughly N tokens.
WORDS = (
    "the of and to in is was for on are with as his they be at one have this from or had by word but "
    "what some we can out other were all there when up use your how said an each she which do their "
    "time if will way about many then them write would like so these her long make thing see him two "
    "has look more day could go come did number sound no most people my over know water than call first"
).split()


@dataclass(slots=True)
class BenchRequest:
    """One request of a workload. Exactly one of `prompt` (completions) and `messages` (chat) is set."""

    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    # Known when the prompt was built from token ids; otherwise the server's usage chunk tells.
    prompt_tokens: int | None = None


@dataclass(slots=True)
class WorkloadSpec:
    """The workload flags of `kvik bench serve`; lengths are in tokens, ranges are inclusive."""

    kind: str = "random"  # "random", "prefix" or a path to a JSONL file
    num_prompts: int = 64
    input_len_range: tuple[int, int] = (64, 256)
    output_len_range: tuple[int, int] = (64, 64)
    prefix_len: int = 1024
    question_len: int = 32
    seed: int = 0


def parse_range(text: str) -> tuple[int, int]:
    """'64,256' -> (64, 256); '128' -> (128, 128). Both ends must be positive."""
    parts = [p.strip() for p in text.split(",")]
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, -1)
    except ValueError:
        raise ConfigError(f"expected a length or a range like 64,256, got {text!r}") from None
    if not 1 <= low <= high:
        raise ConfigError(f"expected a range low,high with 1 <= low <= high, got {text!r}")
    return low, high


def build_workload(spec: WorkloadSpec, chat: bool, vocab_size: int | None) -> list[BenchRequest]:
    """The requests of `spec`; token-id workloads on completions need the server's `vocab_size`."""
    if spec.num_prompts < 1:
        raise ConfigError("--num-prompts must be at least 1")
    rng = random.Random(spec.seed)
    if spec.kind == "random":
        return random_workload(rng, spec, chat, vocab_size)
    if spec.kind == "prefix":
        return prefix_workload(rng, spec, chat, vocab_size)
    return file_workload(Path(spec.kind), rng, spec, chat)


def _output_len(rng: random.Random, spec: WorkloadSpec) -> int:
    return rng.randint(*spec.output_len_range)


def _token_ids(rng: random.Random, n: int, vocab_size: int | None) -> list[int]:
    if vocab_size is None:
        raise ConfigError("token-id prompts need the vocabulary size: pass --vocab-size")
    return [rng.randrange(vocab_size) for _ in range(n)]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def random_workload(rng: random.Random, spec: WorkloadSpec, chat: bool,
                    vocab_size: int | None) -> list[BenchRequest]:
    """Prompt and output lengths uniform in their ranges; token ids (completions) or words (chat)."""
    requests = []
    for _ in range(spec.num_prompts):
        input_len, max_tokens = rng.randint(*spec.input_len_range), _output_len(rng, spec)
        if chat:
            messages = [{"role": "user", "content": _words(rng, input_len)}]
            requests.append(BenchRequest(messages=messages, max_tokens=max_tokens))
        else:
            ids = _token_ids(rng, input_len, vocab_size)
            requests.append(BenchRequest(prompt=ids, max_tokens=max_tokens, prompt_tokens=input_len))
    return requests


def prefix_workload(rng: random.Random, spec: WorkloadSpec, chat: bool,
                    vocab_size: int | None) -> list[BenchRequest]:
    """One shared `prefix_len` system prompt, then a distinct `question_len` question per request."""
    if chat:
        system = _words(rng, spec.prefix_len)
        return [BenchRequest(messages=[{"role": "system", "content": system},
                                       {"role": "user", "content": _words(rng, spec.question_len)}],
                             max_tokens=_output_len(rng, spec))
                for _ in range(spec.num_prompts)]
    prefix = _token_ids(rng, spec.prefix_len, vocab_size)
    requests = []
    for _ in range(spec.num_prompts):
        ids = prefix + _token_ids(rng, spec.question_len, vocab_size)
        requests.append(BenchRequest(prompt=ids, max_tokens=_output_len(rng, spec), prompt_tokens=len(ids)))
    return requests


def file_workload(path: Path, rng: random.Random, spec: WorkloadSpec, chat: bool) -> list[BenchRequest]:
    """The first `num_prompts` lines of a JSONL file of {"prompt": ...} or {"messages": [...]}.

    A line without `max_tokens` gets an output length drawn from the output range. A prompt line sent
    to a chat endpoint becomes one user message; messages cannot go to the completions endpoint.
    """
    if not path.is_file():
        raise ConfigError(f"--workload: expected random, prefix or a JSONL file; {path} is none of them")
    requests = []
    for number, item in jsonl_values(path):
        requests.append(_file_request(item, f"{path}:{number}", rng, spec, chat))
        if len(requests) == spec.num_prompts:
            break  # before the next line is read: what follows the requests used is never parsed
    if not requests:
        raise ConfigError(f"{path}: no requests in the file")
    return requests


def _file_request(item: Any, where: str, rng: random.Random, spec: WorkloadSpec,
                  chat: bool) -> BenchRequest:
    if not isinstance(item, dict) or ("prompt" in item) == ("messages" in item):
        raise ConfigError(f"{where}: each line needs exactly one of 'prompt' and 'messages'")
    max_tokens = item.get("max_tokens")
    if max_tokens is None:
        max_tokens = _output_len(rng, spec)
    elif not isinstance(max_tokens, int) or max_tokens < 1:
        raise ConfigError(f"{where}: max_tokens must be a positive integer")
    prompt, messages = item.get("prompt"), item.get("messages")
    if messages is not None and not chat:
        raise ConfigError(f"{where}: 'messages' needs --endpoint chat")
    if prompt is not None and chat:
        if not isinstance(prompt, str):
            raise ConfigError(f"{where}: token-id prompts need --endpoint completions")
        messages, prompt = [{"role": "user", "content": prompt}], None
    known = len(prompt) if isinstance(prompt, list) else None
    return BenchRequest(prompt=prompt, messages=messages, max_tokens=max_tokens, prompt_tokens=known)
