"""Offline throughput: kvik's engine against HF transformers `generate`, on the same model and the
same prompts (random token ids, per-request output lengths, greedy, EOS ignored).

Throughput counts useful tokens only: each request's prompt plus its own output tokens. A static batch
that runs to its longest member gets no credit for the padding it computes.

Each system runs in its own process (`python -m kvik.bench.offline --system ...`) so that peak memory
and thread pools are measured for it alone; `kvik.bench.compare` starts them.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

SYSTEMS = ("kvik", "hf-sequential", "hf-static")


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


def random_workload(num_requests: int = 64, input_range: tuple[int, int] = (64, 512),
                    output_range: tuple[int, int] = (16, 256), seed: int = 0,
                    vocab: int = 32000) -> Workload:
    """The issue's reference: uniform prompt lengths of random ids and uniform output lengths."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*input_range))]
               for _ in range(num_requests)]
    outputs = [rng.randint(*output_range) for _ in range(num_requests)]
    return Workload(prompts, outputs)


@dataclass(slots=True)
class OfflineResult:
    system: str
    seconds: float
    prompt_tokens: int
    output_tokens: int
    peak_rss_bytes: int  # during generation, sampled
    load_peak_rss_bytes: int  # the process's high-water mark including model loading
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def useful_tokens_per_second(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["useful_tokens_per_second"] = self.useful_tokens_per_second
        data["output_tokens_per_second"] = self.output_tokens_per_second
        return data


class RssSampler:
    """Peak resident memory while a block runs, sampled every 20 ms from /proc."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def current() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.current())

    def __enter__(self) -> RssSampler:
        self.peak = self.current()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.current())


def _load_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_kvik(model: str, workload: Workload, engine_args: dict[str, Any]) -> OfflineResult:
    from kvik import LLM, SamplingParams

    llm = LLM(model, **engine_args)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.max_tokens]
    engine = llm.engine.core
    with RssSampler() as rss:
        started = time.perf_counter()
        outputs = llm.generate(workload.prompts, params, use_tqdm=True)
        seconds = time.perf_counter() - started
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == workload.output_tokens, (produced, workload.output_tokens)
    per_block = engine.kv.pool.num_blocks
    extra = {"weight_bytes": engine.weight_bytes, "kv_cache_bytes": int(engine.runner.kv_cache.numel()
             * engine.runner.kv_cache.element_size()), "kv_blocks": per_block,
             "preemptions": engine.scheduler.num_preemptions, "engine_args": engine_args}
    return OfflineResult("kvik", seconds, workload.prompt_tokens, produced, rss.peak, _load_peak(), extra)


def _hf_model(model: str) -> Any:
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def run_hf_sequential(model: str, workload: Workload) -> OfflineResult:
    """One request at a time through `generate` (the naive server's engine)."""
    import torch

    hf = _hf_model(model)
    produced = 0
    with RssSampler() as rss, torch.inference_mode():
        started = time.perf_counter()
        for prompt, max_tokens in tqdm(list(zip(workload.prompts, workload.max_tokens)),
                                       desc="hf-sequential"):
            ids = torch.tensor([prompt])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                              min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            produced += out.shape[1] - len(prompt)
        seconds = time.perf_counter() - started
    return OfflineResult("hf-sequential", seconds, workload.prompt_tokens, produced, rss.peak, _load_peak())


def run_hf_static(model: str, workload: Workload, batch_size: int = 16) -> OfflineResult:
    """Left-padded static batches: each batch decodes until its longest request is done."""
    import torch

    hf = _hf_model(model)
    useful_outputs = 0
    computed_outputs = 0
    batches = [range(i, min(i + batch_size, len(workload.prompts)))
               for i in range(0, len(workload.prompts), batch_size)]
    with RssSampler() as rss, torch.inference_mode():
        started = time.perf_counter()
        for batch in tqdm(batches, desc="hf-static"):
            prompts = [workload.prompts[i] for i in batch]
            longest = max(len(p) for p in prompts)
            ids = torch.zeros(len(prompts), longest, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, prompt in enumerate(prompts):
                ids[row, longest - len(prompt):] = torch.tensor(prompt)
                mask[row, longest - len(prompt):] = 1
            new = max(workload.max_tokens[i] for i in batch)
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, pad_token_id=0)
            computed_outputs += (out.shape[1] - longest) * len(prompts)
            useful_outputs += sum(workload.max_tokens[i] for i in batch)
        seconds = time.perf_counter() - started
    return OfflineResult("hf-static", seconds, workload.prompt_tokens, useful_outputs, rss.peak,
                         _load_peak(), {"batch_size": batch_size, "computed_output_tokens": computed_outputs})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one system on the offline workload (JSON out).")
    parser.add_argument("--system", choices=SYSTEMS, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len-range", default="64,512")
    parser.add_argument("--output-len-range", default="16,256")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-args", default="{}", help="JSON of kvik engine arguments")
    parser.add_argument("--json", required=True, help="where to write the result")
    args = parser.parse_args(argv)
    vocab = model_vocab_size(args.model)
    workload = random_workload(args.num_requests, _pair(args.input_len_range),
                               _pair(args.output_len_range), args.seed, vocab)
    if args.system == "kvik":
        result = run_kvik(args.model, workload, {"show_progress": False, **json.loads(args.engine_args)})
    elif args.system == "hf-sequential":
        result = run_hf_sequential(args.model, workload)
    else:
        result = run_hf_static(args.model, workload)
    Path(args.json).write_text(json.dumps(result.to_dict(), indent=2))
    return 0


def model_vocab_size(model: str) -> int:
    """The embedding rows of an HF model directory or a GGUF file (the range of random prompt ids)."""
    from kvik.model.formats.gguf import gguf_hf_config, is_gguf_file

    if is_gguf_file(Path(model)):
        return gguf_hf_config(Path(model))["vocab_size"]
    return json.loads((Path(model) / "config.json").read_text())["vocab_size"]


def _pair(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    return low, high


if __name__ == "__main__":
    raise SystemExit(main())
