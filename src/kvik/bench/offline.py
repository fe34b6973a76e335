"""Offline throughput: kvik's engine against HF transformers `generate`, on the same model and the
same prompts (random token ids, per-request output lengths, greedy, EOS ignored).

Throughput counts useful tokens only: each request's prompt plus its own output tokens. A static batch
that runs to its longest member gets no credit for the padding it computes.

Each system runs in its own process (`python -m kvik.bench.offline --system ...`) so that peak memory
and thread pools are measured for it alone; `kvik.bench.compare` starts them.

Every system runs on the same device in the same dtype (`--device`, `--dtype`): on the CPU kvik keeps
float32 activations and narrows the weights only, HF computes in the dtype; on CUDA both compute in it.
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
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_device_dtype(device: str = "auto", dtype: str = "auto") -> tuple[str, str]:
    """Explicit names for `auto`, as kvik's engine picks them (kvik.engine.device): the device is
    cuda when torch sees one, else cpu; the dtype bfloat16 on CUDA (float16 on GPUs without bf16),
    float32 on the CPU. Resolved once by the parent so that every child, kvik's and HF's, gets the
    same explicit values. Raises ConfigError for cuda on a machine without one."""
    from kvik.engine.device import select_device, select_dtype

    torch_device = select_device(device)
    return torch_device.type, str(select_dtype(dtype, torch_device)).removeprefix("torch.")


def synchronize(device: str) -> None:
    """Wait for the device's queued work: CUDA calls return before the GPU is done, so a timer
    read without this would stop early. A no-op on the CPU."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _reset_device_peak(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats()


def _device_peak(device: str) -> int | None:
    """The most CUDA memory PyTorch's allocator held for tensors since _reset_device_peak (weights
    and KV cache included: they were allocated before it); None on the CPU, where RSS says it."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.max_memory_allocated())
    return None


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
    device: str = "cpu"
    dtype: str = "float32"
    # On CUDA: torch.cuda.max_memory_allocated() over the timed region (weights and KV included);
    # None on the CPU.
    peak_device_bytes: int | None = None

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
    """kvik's engine; `engine_args` are LLM(...)'s (device and dtype among them)."""
    from kvik import LLM, SamplingParams

    llm = LLM(model, **engine_args)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.max_tokens]
    engine = llm.engine.core
    device = engine.device.type
    synchronize(device)
    _reset_device_peak(device)
    with RssSampler() as rss:
        started = time.perf_counter()
        outputs = llm.generate(workload.prompts, params, use_tqdm=True)
        synchronize(device)
        seconds = time.perf_counter() - started
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == workload.output_tokens, (produced, workload.output_tokens)
    per_block = engine.kv.pool.num_blocks
    extra = {"weight_bytes": engine.weight_bytes, "kv_cache_bytes": engine.runner.kv_cache.nbytes,
             "kv_blocks": per_block,
             "preemptions": engine.scheduler.num_preemptions, "engine_args": engine_args}
    return OfflineResult("kvik", seconds, workload.prompt_tokens, produced, rss.peak, _load_peak(), extra,
                         device=device, dtype=engine.args.dtype, peak_device_bytes=_device_peak(device))


def _hf_model(model: str, device: str = "cpu", dtype: str = "float32") -> Any:
    """The HF model in `dtype` on `device` (the same card and dtype kvik runs on)."""
    import torch
    import transformers

    from kvik.bench.roofline import DTYPES

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=DTYPES[dtype])
    return hf.to(torch.device(device)).eval()


def run_hf_sequential(model: str, workload: Workload, device: str = "cpu",
                      dtype: str = "float32") -> OfflineResult:
    """One request at a time through `generate` (the naive server's engine)."""
    import torch

    hf = _hf_model(model, device, dtype)
    produced = 0
    synchronize(device)
    _reset_device_peak(device)
    with RssSampler() as rss, torch.inference_mode():
        started = time.perf_counter()
        for prompt, max_tokens in tqdm(list(zip(workload.prompts, workload.max_tokens)),
                                       desc="hf-sequential"):
            ids = torch.tensor([prompt], device=device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                              min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            produced += out.shape[1] - len(prompt)
        synchronize(device)
        seconds = time.perf_counter() - started
    return OfflineResult("hf-sequential", seconds, workload.prompt_tokens, produced, rss.peak, _load_peak(),
                         device=device, dtype=dtype, peak_device_bytes=_device_peak(device))


def run_hf_static(model: str, workload: Workload, batch_size: int = 16, device: str = "cpu",
                  dtype: str = "float32") -> OfflineResult:
    """Left-padded static batches: each batch decodes until its longest request is done."""
    import torch

    hf = _hf_model(model, device, dtype)
    useful_outputs = 0
    computed_outputs = 0
    batches = [range(i, min(i + batch_size, len(workload.prompts)))
               for i in range(0, len(workload.prompts), batch_size)]
    synchronize(device)
    _reset_device_peak(device)
    with RssSampler() as rss, torch.inference_mode():
        started = time.perf_counter()
        for batch in tqdm(batches, desc="hf-static"):
            prompts = [workload.prompts[i] for i in batch]
            longest = max(len(p) for p in prompts)
            # Built on the CPU (row by row), then moved to the device in one copy each.
            ids = torch.zeros(len(prompts), longest, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, prompt in enumerate(prompts):
                ids[row, longest - len(prompt):] = torch.tensor(prompt)
                mask[row, longest - len(prompt):] = 1
            new = max(workload.max_tokens[i] for i in batch)
            out = hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, pad_token_id=0)
            computed_outputs += (out.shape[1] - longest) * len(prompts)
            useful_outputs += sum(workload.max_tokens[i] for i in batch)
        synchronize(device)
        seconds = time.perf_counter() - started
    return OfflineResult("hf-static", seconds, workload.prompt_tokens, useful_outputs, rss.peak,
                         _load_peak(), {"batch_size": batch_size, "computed_output_tokens": computed_outputs},
                         device=device, dtype=dtype, peak_device_bytes=_device_peak(device))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one system on the offline workload (JSON out).")
    parser.add_argument("--system", choices=SYSTEMS, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len-range", default="64,512")
    parser.add_argument("--output-len-range", default="16,256")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-args", default="{}",
                        help="JSON of kvik engine arguments (device and dtype come from --device/--dtype)")
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="where every system runs (default auto: cuda when torch sees one, else cpu)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="the dtype every system loads the weights in (default auto: bfloat16 on "
                             "cuda, float32 on cpu; kvik under auto also keeps a quantized checkpoint's "
                             "format)")
    parser.add_argument("--json", required=True, help="where to write the result")
    args = parser.parse_args(argv)
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    vocab = model_vocab_size(args.model)
    workload = random_workload(args.num_requests, _pair(args.input_len_range),
                               _pair(args.output_len_range), args.seed, vocab)
    if args.system == "kvik":
        # The dtype as given: under auto kvik picks the same float dtype as resolve_device_dtype, and
        # also keeps a quantized checkpoint's own format (a Q8_0 GGUF as int8, int4 layers), which an
        # explicit dtype would dequantize. `kvik bench compare` passes explicit names, so that kvik
        # and the HF baselines load the weights alike.
        engine_args = {"show_progress": False, **json.loads(args.engine_args), "device": device,
                       "dtype": args.dtype}
        result = run_kvik(args.model, workload, engine_args)
    elif args.system == "hf-sequential":
        result = run_hf_sequential(args.model, workload, device, dtype)
    else:
        result = run_hf_static(args.model, workload, device=device, dtype=dtype)
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
